"""hpnlp.retrieval's ScaNN adapter: the leaf count of each build (tests/test_retrieval.py
holds the adapters' shared tests)."""

import json
import os

import numpy as np
import pytest

from hpnlp import retrieval
from hpnlp.retrieval import external

pytestmark = pytest.mark.skipif(not external.available("scann"), reason="scann is not installed")


def _unit(n, seed):
    x = np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _saved(folder):
    """(the `leaves` option in index.json, the leaf count of the saved searcher's tree)."""
    with open(os.path.join(folder, "index.json")) as f:
        option = json.load(f)["options"]["leaves"]
    from scann.proto import scann_pb2
    with open(os.path.join(folder, "scann", "scann_config.pb"), "rb") as f:
        built = scann_pb2.ScannConfig.FromString(f.read()).partitioning.num_children
    return option, built


def test_leaves_0_is_chosen_again_at_each_build_and_saved_as_given(tmp_path):
    # review r1: the count chosen for leaves=0 at the first build was written over the
    # option, so a rebuild after more adds, a save and a reload all kept 1 leaf for 100 vectors
    index = retrieval.make("scann", 16)
    index.add(_unit(100, 0))
    index.search(_unit(2, 1), 1)
    assert index.options["leaves"] == 0 and index._leaves == 1  # min(100 // 100, 20)
    index.add(_unit(2400, 2))
    q = _unit(3, 3)
    _, ids = index.search(q, 1)
    assert _saved(index.save(str(tmp_path / "a"))) == (0, 25)  # min(2500 // 100, 100)
    assert index._leaves == 25
    back = retrieval.load(str(tmp_path / "a"))
    assert (back.options["leaves"], back._leaves) == (0, 25)
    np.testing.assert_array_equal(back.search(q, 1)[1], ids)
    back.add(_unit(1100, 4))
    back.search(q, 1)
    assert back._leaves == 36  # min(3600 // 100, 120)
    assert _saved(back.save(str(tmp_path / "b"))) == (0, 36)


def test_leaves_given_are_kept_through_rebuilds_and_reloads(tmp_path):
    index = retrieval.make("scann", 16, leaves=7)
    index.add(_unit(100, 0))
    index.search(_unit(2, 1), 1)
    index.add(_unit(900, 2))
    assert _saved(index.save(str(tmp_path / "a"))) == (7, 7)
    back = retrieval.load(str(tmp_path / "a"))
    assert (back.options["leaves"], back._leaves) == (7, 7)
