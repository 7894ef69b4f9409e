"""Evaluating trained attnres models, and looking at what their depth attention learned.

    python -m evaluation <path or run id> [--tasks hellaswag,lambada_openai,wikitext] [--probe]
    python -m evaluation.lm_eval_cli --model attnres --model_args pretrained=<path or run id> --tasks …
    python -m evaluation.explorer <path or run id> --out depth.html

One module per concept (source, tokenizer, heldout, probe, harness_tasks, tracking, explorer, cli);
lm-eval and mlflow load only when used. See docs/EVALUATION.md.
"""
