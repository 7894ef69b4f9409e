"""`lm_eval`'s own command line with the `attnres` model registered.

    attnres-lm-eval --model attnres --model_args pretrained=<path or run id> --tasks hellaswag
    python -m evaluation.lm_eval_cli ...    # the same, also from a checkout (PYTHONPATH=.)

lm-eval finds models only by import, so this imports the adapter and hands the unchanged arguments
to lm-eval's CLI. A `pretrained=` that cannot be loaded is one line and exit status 2.
"""
from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> None:
    try:
        from lm_eval.__main__ import cli_evaluate

        from . import lm_eval_adapter  # noqa: F401  (registers "attnres")
    except ImportError as e:
        print(f"lm_eval_cli: lm-evaluation-harness is not installed ({e}); pip install 'lm-eval==0.4.13'", file=sys.stderr)
        raise SystemExit(2) from None
    from attnres.io import CheckpointError

    from .tokenizer import TokenizerError

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except (CheckpointError, TokenizerError) as e:
        # pretrained= that cannot be loaded, or no tokenizer for it: our one-line messages, which
        # reached the user as the last line of a traceback through lm-eval's model construction.
        print(f"lm_eval_cli: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
