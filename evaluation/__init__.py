"""Evaluating trained attnres models, and looking at what their depth attention learned.

    python -m evaluation <path or run id> [--tasks hellaswag,lambada_openai,wikitext] [--probe]
    python -m evaluation.lm_eval_cli --model attnres --model_args pretrained=<path or run id> --tasks …
    python -m evaluation.explorer <path or run id> --out depth.html

Modules, one concept each: source (what to evaluate: checkpoint or MLflow run, and its data),
tokenizer (bytes / GPT-2 BPE), heldout (loss, bits per byte), probe (multi-hop accuracy),
lm_eval_adapter (the lm-eval model `attnres`), harness_tasks (running lm-eval tasks, flattening
their metrics), lm_eval_cli (lm_eval's CLI with `attnres` registered), tracking (logging back into
the MLflow run), explorer (the depth-map explorer command), explorer_page (its HTML page), cli (the
evaluation command). Nothing heavy is imported here: lm-eval and mlflow load only when used.
See docs/EVALUATION.md.
"""
