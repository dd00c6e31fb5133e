"""Every notebook in colabs/ runs top to bottom on tiny settings, so none can rot."""

import glob
import os

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

import hpnlp  # noqa: F401  (before any JAX computation: its XLA flags; the cell tests import it)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colabs", "*.ipynb")))


def test_there_are_notebooks():
    assert any(p.endswith("quickstart.ipynb") for p in NOTEBOOKS)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_executes(path, tmp_path, monkeypatch):
    # HPNLP_NOTEBOOK_STACK passes through from the caller's environment: parallelism's stacked
    # layers and pipeline mode cost 56 s against 17 s (one core of a 2-core Xeon, session 108:
    # four modes of depth 2, each ~11 s to compile init and step), so the suite leaves them to
    # `HPNLP_NOTEBOOK_STACK=1 python -m pytest tests/test_colabs.py -k parallelism`.
    monkeypatch.setenv("HPNLP_NOTEBOOK_QUICK", "1")  # the tiny settings
    monkeypatch.setenv("HPNLP_NOTEBOOK_STEPS", "20")  # quickstart's steps
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # the notebooks' own temporary folders (quickstart's workdirs) go with the test's
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    # this checkout's package, installed or not (a review, session 118: the kernel, started in
    # tmp_path, imported hpnlp only where it was pip-installed)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


def _cells(name):
    nb = nbformat.read(os.path.join(ROOT, "colabs", name), as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _markdown(name):
    nb = nbformat.read(os.path.join(ROOT, "colabs", name), as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


@pytest.mark.parametrize("steps", [1, 2, 20])
def test_quickstart_any_step_count_configures_and_its_loss_check_says_what_to_try(
        steps, tmp_path, monkeypatch, capsys):
    """HPNLP_NOTEBOOK_STEPS=1 was refused (warmup 1 not below 1 step) and a loss that did not
    fall was a bare `assert`: the config now validates for any count, and the check names the
    losses and what to try (a note where the steps are too few to expect a fall)."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    from hpnlp.config import from_configdict, validate
    monkeypatch.setenv("HPNLP_NOTEBOOK_STEPS", str(steps))
    setup, config, _, check = _cells("quickstart.ipynb")[:4]
    assert "metrics.jsonl" in check  # the loss-curve cell
    ns = {}
    exec(setup, ns)
    exec(config, ns)
    validate(from_configdict(ns["cfg"]))
    with open(tmp_path / "metrics.jsonl", "w") as f:  # a loss that rose
        for step, loss in ((1, 5.0), (steps, 5.5)):
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    ns.update(workdir=str(tmp_path), summary={"baseline": {"unigram_loss": 3.0}})
    if steps < 10:
        exec(check, ns)
        assert "did not fall (5.000 at step 1, 5.500" in capsys.readouterr().out
    else:
        with pytest.raises(RuntimeError, match=r"did not fall .*: try a lower cfg.train.lr"):
            exec(check, ns)
    ns["plt"].close("all")


def test_quickstart_attention_choices_it_offers_validate(monkeypatch):
    """The config cell said `try "chunked" or "xla"`, and "xla" was refused with the cell's
    packed batches: every name its comment offers validates as the comment says."""
    import re

    from hpnlp.config import from_configdict, validate
    monkeypatch.setenv("HPNLP_NOTEBOOK_STEPS", "20")
    setup, config = _cells("quickstart.ipynb")[:2]
    ns = {}
    exec(setup, ns)
    exec(config, ns)
    lines = config.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("cfg.attention.name ="))
    offered = {}  # the names the comment offers: on its first line as they are, then with "pad"
    for ln, batching in ((lines[at], "pack"), (lines[at + 1], "pad")):
        offered.update({name: batching for name in re.findall(r'"(\w+)"', ln.partition("#")[2])
                        if name not in ("pad", "pack")})
    assert {"chunked", "xla"} <= set(offered), offered
    # and "local" with the block the comment gives (its default block is the whole sequence),
    # with "pad" too (a review, session 115: a new run of it on packed rows is refused)
    local = re.search(r'"local" with cfg.attention.options = (\{[^}]*\})', lines[at + 2])
    assert '"pad" too' in lines[at + 3], lines[at + 3]
    offered["local"] = ("pad", eval(local.group(1)))
    from hpnlp.config.checks import check_new_run
    for name, batching in offered.items():
        batching, options = batching if isinstance(batching, tuple) else (batching, {})
        cfg = ns["cfg"].copy_and_resolve_references()
        cfg.attention.name, cfg.attention.options, cfg.data.batching = name, options, batching
        check_new_run(validate(from_configdict(cfg)))  # as a new run of it is


def _keep_this_process_cache(monkeypatch):
    """The cell applies hpnlp's workarounds for the 8 devices it asks for, which would turn
    this test process's persistent compilation cache off (a review, session 117): kept on."""
    from hpnlp import xla_workarounds
    monkeypatch.setattr(xla_workarounds, "guard_cache", lambda: [])


def test_parallelism_says_when_jax_has_not_8_devices(monkeypatch):
    """With JAX already started on one device (or XLA_FLAGS of the user's own), the notebook
    failed three cells later in a reshape ("cannot reshape array of size 4 into shape
    (8,1,1,1,1,1)"): its first cell says what to do."""
    import jax
    if jax.device_count() == 8:
        pytest.skip("this process has 8 devices")
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the cell adds to it
    _keep_this_process_cache(monkeypatch)
    with pytest.raises(RuntimeError, match=r"meshes are of 8 devices and JAX has \d+ .*restart"):
        exec(_cells("parallelism.ipynb")[0], {})


def test_notebook_settings_have_one_meaning_each_and_name_themselves(monkeypatch):
    """A bug hunt (session 95): HPNLP_NOTEBOOK_STEPS was quickstart's step count and every
    other notebook's "tiny settings" switch (1000 steps asked ran them tiny); 'abc' was a bare
    int() error."""
    from hpnlp import notebook
    monkeypatch.delenv("HPNLP_NOTEBOOK_QUICK", raising=False)
    monkeypatch.setenv("HPNLP_NOTEBOOK_STEPS", "1000")
    assert notebook.steps(300) == 1000 and not notebook.quick()
    monkeypatch.setenv("HPNLP_NOTEBOOK_QUICK", "1")
    assert notebook.quick()
    monkeypatch.setenv("HPNLP_NOTEBOOK_STACK", "1")
    assert notebook.stack() and notebook.steps(300) == 1000
    read = {"HPNLP_NOTEBOOK_QUICK": notebook.quick, "HPNLP_NOTEBOOK_STACK": notebook.stack,
            "HPNLP_NOTEBOOK_STEPS": lambda: notebook.steps(300)}
    for var, value in (("HPNLP_NOTEBOOK_QUICK", "yes"), ("HPNLP_NOTEBOOK_STEPS", "abc"),
                       ("HPNLP_NOTEBOOK_STEPS", "0"), ("HPNLP_NOTEBOOK_STACK", "True")):
        monkeypatch.setenv(var, value)
        with pytest.raises(ValueError, match=rf"^{var}='{value}': "):
            read[var]()


def test_parallelism_reads_stack_from_its_setting(monkeypatch):
    """STACK = False was written in the cell, so the stacked layers and the pipeline mode the
    text offers could not be run by a test (a review, session 108): HPNLP_NOTEBOOK_STACK."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the cell adds to it
    _keep_this_process_cache(monkeypatch)
    for value, want in (("1", True), ("", False)):
        monkeypatch.setenv("HPNLP_NOTEBOOK_STACK", value)
        ns = {}
        try:
            exec(_cells("parallelism.ipynb")[0], ns)
        except RuntimeError:  # not 8 devices in this process: said after STACK is read
            pass
        assert ns["STACK"] is want


def test_attention_zoo_model_runs_chunkeds_kernel():
    """Its model section gave `chunked` block_q / block_k, which select the XLA program, so
    the only model in colabs/ with `chunked` never ran its fused kernel (a review, session
    108): the config the cell builds, full and tiny, runs the kernel where there is one."""
    from hpnlp import attention
    from hpnlp.attention import chunked
    from hpnlp.config import from_configdict
    if (why := chunked.kernel_blocker(16, 16, "auto", None, None)) is not None:
        pytest.skip(f"no fused attention kernel here: {why}")
    cell = _cells("attention_zoo.ipynb")[3]
    config = cell[:cell.index("summary = train.run(")]  # the config lines, not the training
    for quick in (True, False):
        ns = {"QUICK": quick}
        exec(config, ns)
        cfg = from_configdict(ns["cfg"])
        assert cfg.attention.name == "chunked"
        layer = attention.get("chunked")(**dict(cfg.attention.options))
        D = cfg.model.dims_per_head()
        assert chunked.kernel_blocker(D, D, layer.impl, layer.block_q, layer.block_k) is None


def test_quantization_quantizes_the_products_its_kernels_serve():
    """Its w8a8 (static ranges) and binary (weights only) models were served decoded in XLA
    while §3 timed the kernels as theirs (a review, session 108): each kernel §3 times is
    the one of a model the notebook quantizes."""
    import ast
    import inspect
    import re

    from hpnlp.compress import kernels, qlinear
    from hpnlp.config import QuantConfig
    cell = _cells("quantization.ipynb")[1]
    assign = next(n for n in ast.parse(cell).body if isinstance(n, ast.Assign)
                  and [getattr(t, "id", None) for t in n.targets] == ["settings"])
    settings = eval(compile(ast.Expression(assign.value), "settings", "eval"),
                    {"QuantConfig": QuantConfig})
    assert "kernels.time_linear(" in _cells("quantization.ipynb")[3]
    timed = set(re.findall(r'"(\w+)_kernel"', inspect.getsource(kernels.time_linear)))
    assert timed == {"int8", "binary", "int4"}, timed
    for fmt in timed:
        served = [name for name, q in settings.items()
                  if q.weights == fmt and qlinear.kernel_for(q, fmt) is not None]
        assert served, f"no setting quantizes a product the {fmt} kernel computes: {settings}"


def test_every_notebook_says_how_to_install_hpnlp_in_its_introduction():
    """A review (session 115): seven notebooks said nothing of installing hpnlp, and their
    first code cell failed on a fresh Colab runtime with ModuleNotFoundError."""
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert nb.cells[0].cell_type == "markdown", os.path.basename(path)  # before any code
        assert "pip install" in nb.cells[0].source, os.path.basename(path)


def test_notebooks_that_read_experiments_say_to_clone_the_repository():
    """approximate_softmax's quality section reads experiments/lm.py, which a pip install
    lacks, and its text said nothing (a review, session 108): every notebook whose code
    reaches harness.experiment_module says how to get a checkout before any long work."""
    import re
    reaching = []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        benches = [os.path.join(ROOT, "hpnlp", "bench", m + ".py")
                   for m in re.findall(r"from hpnlp\.bench import (\w+)", code)]
        if "experiment_module" in code or any(
                "experiment_module(" in open(b).read() for b in benches if os.path.isfile(b)):
            reaching.append(os.path.basename(path))
            intro = next(c.source for c in nb.cells if c.cell_type == "markdown")
            assert "git clone" in intro and "pip install -e" in intro, path
    assert {"approximate_softmax.ipynb", "retrieval.ipynb"} <= set(reaching), reaching


def test_attention_zoo_patterns_raise_a_variant_that_fails_on_the_tests_settings(monkeypatch):
    """A variant that raised drew its error as a plot title and the notebook test passed (a
    review, session 108): on the tests' settings the cell raises, naming it."""
    import matplotlib
    matplotlib.use("Agg")
    from hpnlp import attention

    class Broken:
        def __init__(self, **_):
            raise ValueError("boom")
    get = attention.get
    monkeypatch.setattr(attention, "names", lambda: ["dense", "broken"])
    monkeypatch.setattr(attention, "get", lambda name: Broken if name == "broken" else get(name))
    monkeypatch.setenv("HPNLP_NOTEBOOK_QUICK", "1")
    setup, patterns = _cells("attention_zoo.ipynb")[:2]
    ns = {}
    exec(setup, ns)
    with pytest.raises(RuntimeError, match=r"^variants that failed at L=32: "
                                           r"\{'broken': 'ValueError: boom'\}$"):
        exec(patterns, ns)
    ns["plt"].close("all")


def test_approximate_softmax_raises_a_layer_whose_log_prob_does_not_sum_to_one(monkeypatch):
    """Its section 1 "checks that every method's evaluation distribution sums to one" and only
    printed the largest row sum, so a layer off on some rows or everywhere left the notebook
    test green (review r6): the cell raises, naming the method and its smallest..largest sum."""
    from hpnlp import softmax
    full, get = softmax.get("full"), softmax.get

    class Shifted(full):
        def log_prob(self, hidden_NE):
            return super().log_prob(hidden_NE) - 0.1  # every row sums to exp(-0.1)
    monkeypatch.setattr(softmax, "names", lambda: ["full", "shifted"])
    monkeypatch.setattr(softmax, "get", lambda name: Shifted if name == "shifted" else get(name))
    setup, check = _cells("approximate_softmax.ipynb")[:2]
    assert "Every method defines a distribution" in _markdown("approximate_softmax.ipynb")[1]
    ns = {}
    exec(setup, ns)
    with pytest.raises(RuntimeError, match=r"^log_prob does not sum to 1 .*: "
                                           r"\{'shifted': '0\.9048\d\d\.\.0\.9048\d\d'\}$"):
        exec(check, ns)


def test_compression_raises_a_pruned_kernel_off_its_sparsity(monkeypatch, tmp_path):
    """Its section 2 said the pruned weights' zeros match the target and only printed them
    (review r6): on a kernel whose zeros are off the target the cell raises, naming it. The
    runs are stood in for (their summaries, the kernel's parameters): the cell's check alone."""
    import tempfile
    import types

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the setup cell's `work`
    monkeypatch.setenv("HPNLP_NOTEBOOK_QUICK", "1")
    cells = _cells("compression.ipynb")
    assert "fraction of exact\nzeros in the pruned weights" in _markdown("compression.ipynb")[2]
    ns = {}
    exec(cells[0], ns)
    kernel = np.ones((4, 100), np.float32)
    kernel[:, :50] = 0  # 50% zero: right for 0.5, off for 0.9
    params = {"trunk": {"block_0": {"mlp_in": {"kernel": kernel}}}}
    ns.update(W=32, D=2, params_of=lambda out: params,
              train=types.SimpleNamespace(run=lambda cfg, out: {"eval": {"loss": 1.0}}))
    with pytest.raises(RuntimeError, match=r"^magnitude pruning to 90% left 50\.0% of "
                                           r"block_0/mlp_in's kernel zero$"):
        exec(cells[2], ns)


SKIPPED = {"status": "skipped: torch not installed (pip install -e '.[bench]')"}


@pytest.mark.parametrize("name,cell,module,pngs,payload", [
    ("attention_zoo.ipynb", 2, "attention", ("attention_time_fwd_bwd.png", "attention_memory.png"),
     {"results": [{"status": "ok"}, SKIPPED]}),
    ("approximate_softmax.ipynb", 2, "softmax", ("softmax_time.png",),
     {"results": [{"status": "ok"}, SKIPPED],
      "summary": {"speedup_vs_full": {"full": {1024: 1.0}}}}),
    ("approximate_softmax.ipynb", 3, "quality", ("softmax_quality.png",),
     {"results": [{"method": "full", "perplexity": 9.0}]}),
], ids=["attention_zoo-bench", "approximate_softmax-bench", "approximate_softmax-quality"])
def test_benchmark_cells_raise_a_failed_row_on_the_tests_settings(
        name, cell, module, pngs, payload, monkeypatch):
    """The harness reports a row that raised as status 'failed: ...' and the cells only
    plotted the rows, so a broken variant or method left the notebook test green (a review,
    session 108): on the tests' settings a failed row raises; a skipped one does not."""
    import importlib

    import matplotlib
    matplotlib.use("Agg")
    bench = importlib.import_module(f"hpnlp.bench.{module}")

    def run_with(*extra):  # the bench's `run`: its plots (empty files) and these rows
        def run(out, **_):
            for png in pngs:
                with open(os.path.join(out, png), "wb") as f:
                    f.write(b"\x89PNG\r\n\x1a\n")
            return {**payload, "results": payload["results"] + list(extra)}
        return run
    monkeypatch.setenv("HPNLP_NOTEBOOK_QUICK", "1")
    setup, code = _cells(name)[0], _cells(name)[cell]
    ns = {}
    exec(setup, ns)
    monkeypatch.setattr(bench, "run", run_with())
    exec(code, ns)  # the rows that ran, and those that cannot by design
    monkeypatch.setattr(bench, "run", run_with({"method": "sampled", "status": "failed: boom"}))
    with pytest.raises(RuntimeError, match=r"that failed: \[\{'method': 'sampled', "
                                           r"'status': 'failed: boom'\}\]$"):
        exec(code, ns)
    ns["plt"].close("all")
