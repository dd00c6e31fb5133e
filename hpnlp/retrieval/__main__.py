"""`python -m hpnlp.retrieval COMMAND`: retrieval on trained hpnlp runs.

    python -m hpnlp.retrieval knnlm --workdir TRAINED_LM --datastore DIR [--index exact] [--out DIR]
    python -m hpnlp.retrieval encoder --workdir TRAINED_BI_ENCODER [--out DIR]

`knnlm` (hpnlp.retrieval.knnlm): builds the run's training-split datastore in DIR (once;
reused by later calls, refused if another model built it), searches the neighbours of the
held-out targets, tunes k / temperature / lambda on half of them and reports the
perplexity with and without the datastore on the other half (printed, and OUT/summary.json).

`encoder` (hpnlp.retrieval.encoder): recall@1, recall@10 and MRR of a trained bi-encoder's
held-out pairs searched against the whole held-out pool (printed, and OUT/summary.json).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpnlp.retrieval", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser("knnlm", help="kNN-LM perplexity of a trained LM")
    k.add_argument("--workdir", required=True, help="a trained LM run (python -m hpnlp.main)")
    k.add_argument("--datastore", required=True, help="folder of the datastore (built if empty)")
    k.add_argument("--index", default="exact", help="an hpnlp.retrieval index name")
    k.add_argument("--index_options", default="{}", help='JSON, e.g. \'{"nprobe": 32}\'')
    k.add_argument("--metric", default="l2", help="l2 (the paper's) | ip")
    k.add_argument("--max_eval_tokens", type=int, default=0, help="0: the whole held-out split")
    k.add_argument("--max_datastore_tokens", type=int, default=0,
                   help="0: every training token; N: the first training chunks' N (a quick try)")
    k.add_argument("--out", default=None, help="folder for summary.json")
    e = sub.add_parser("encoder", help="held-out recall@1/10 and MRR of a trained bi-encoder")
    e.add_argument("--workdir", required=True, help="a trained bi-encoder run (experiments/encoder.py)")
    e.add_argument("--out", default=None, help="folder for summary.json")
    args = p.parse_args(argv)
    from hpnlp.retrieval import RetrievalError, encoder, knnlm
    from hpnlp.stopping import sigterm_as_interrupt
    try:
        with sigterm_as_interrupt():  # as Ctrl-C: a partial datastore removed, said
            if args.command == "encoder":
                summary = encoder.evaluate(args.workdir, out=args.out)
            else:
                try:
                    options = json.loads(args.index_options)
                except json.JSONDecodeError as e:
                    raise RetrievalError(f"--index_options {args.index_options!r} is not JSON "
                                         f"({e}); give an object, e.g. '{{\"nprobe\": 32}}'"
                                         ) from None
                if not isinstance(options, dict):
                    raise RetrievalError(f"--index_options {args.index_options!r} is JSON but not "
                                         'an object; give one, e.g. \'{"nprobe": 32}\'')
                summary = knnlm.run(args.workdir, args.datastore, index=args.index,
                                    index_options=options, metric=args.metric,
                                    max_eval_tokens=args.max_eval_tokens,
                                    max_datastore_tokens=args.max_datastore_tokens, out=args.out)
    # RetrievalError, ConfigError, CheckpointMismatch (a README walk's seed ensemble), a JSON
    # error and a prepared folder's damaged shard are each a ValueError, said in one line as
    # the other CLIs say them (a bug hunt, session 98: a traceback)
    except (ValueError, FileNotFoundError) as e:
        print(f"hpnlp.retrieval: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # a README walk: a traceback (a datastore's rerun starts
        # over); SIGTERM likewise (a bug hunt: it left a partial datastore, unsaid)
        print(f"hpnlp.retrieval: {str(e) or 'interrupted'}; rerun the same command to start "
              "again", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
