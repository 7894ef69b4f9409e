"""`python -m evaluation.export <run id or model folder> --out DIR`: a trained run as a Hugging Face folder.

    python -m evaluation.export 3f2a…c9 --out hf/block-s0 --log-to-run
    model = AutoModelForCausalLM.from_pretrained("hf/block-s0", trust_remote_code=True)
    lm_eval --model hf --model_args pretrained=hf/block-s0,trust_remote_code=True --tasks ...

The folder holds config.json (its auto_map names the shipped code), model.safetensors, the model's
code (evaluation/hf/modeling_attnres.py, which imports the installed `attnres`), generation_config.json
and the run's tokenizer: the byte tokenizer's code (tokenization_attnres.py) or GPT-2's tokenizer.json.
The folder is written beside DIR and renamed into place once the reloaded model's logits match the
run's, so a failed export leaves nothing behind. Bad input: one line, exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

LOGITS_ATOL = 1e-5  # float32: the reloaded folder's logits against attnres.load's
ARTIFACT_PATH = "hf"  # where --log-to-run puts the folder in the run


class ExportError(ValueError):
    """Input the export cannot use (one line: what, where, what is allowed)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evaluation.export", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="checkpoint folder or file, MLflow run id, or runs:/<run id>[/folder]")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    p.add_argument("--tokenizer", choices=("bytes", "gpt2"), default=None, help="default: implied by the vocabulary size")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else run.py's <project root>/mlflow.db)")
    p.add_argument("--log-to-run", action="store_true", help=f"also log the folder into the source run as artifact {ARTIFACT_PATH}/")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from attnres.io import CheckpointError, parse_run_reference

    from .tokenizer import TokenizerError

    run = parse_run_reference(args.source) if not Path(args.source).expanduser().exists() else None
    try:
        _require_transformers()
        if args.log_to_run and run is None:
            raise ExportError(f"--log-to-run: {args.source} is not an MLflow run id or runs:/ URI; allowed: a run id as the source")
        out = export(args.source, args.out, tokenizer=args.tokenizer, tracking_uri=args.tracking_uri)
    except (CheckpointError, TokenizerError, ExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    if args.log_to_run:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(tracking_uri=_tracking_uri(args.tracking_uri)).log_artifacts(run[0], str(out), ARTIFACT_PATH)
        except (MlflowException, OSError) as e:
            print(f"error: {out} is written, but logging it into run {run[0]} failed: {' '.join(str(e).split())[:300]}",
                  file=sys.stderr)
            return 1
        print(f"logged {out} into run {run[0]} as {ARTIFACT_PATH}/")
    return 0


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ExportError("the export needs transformers: pip install -e '.[hf]'") from None


def export(source: str, out: str, tokenizer: Optional[str] = None, tracking_uri: Optional[str] = None) -> Path:
    """Write the Hugging Face folder of `source` (anything attnres.load reads) at `out`; return it."""
    from attnres.io import load

    target = Path(out).expanduser().resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"--out {out}: exists and is not an empty folder; allowed: a new or empty folder")
    if not target.parent.is_dir():
        raise ExportError(f"--out {out}: its parent folder {target.parent} does not exist")
    model, config = load(source, device="cpu", tracking_uri=_tracking_uri(tracking_uri))
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp:
        staged = Path(tmp) / "export"
        write_folder(model, config, staged, tokenizer=tokenizer)
        check_folder(model, staged)
        if target.exists():
            target.rmdir()  # empty, checked above
        os.replace(staged, target)
    return target


def write_folder(model, config: dict, folder: Path, tokenizer: Optional[str] = None) -> None:
    """config.json, model.safetensors and the code of the model, and the tokenizer, into `folder`."""
    import attnres
    from .hf.modeling_attnres import AttnResConfig, AttnResForCausalLM
    from .tokenizer import prefix_id, tokenizer_for

    tok = tokenizer_for(model.config.vocab_size, tokenizer)
    prefix = prefix_id(tok, config)
    AttnResConfig.register_for_auto_class()
    AttnResForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    hf_config = AttnResConfig(
        attnres_model=_plain(model.config), attnres_residual=_plain(model.residual_config),
        bos_token_id=prefix, eos_token_id=tok.eot_id, pad_token_id=tok.eot_id,
        attnres_version=getattr(attnres, "__version__", None) or _project_version(),
    )
    hf = AttnResForCausalLM(hf_config)
    hf.model.load_state_dict(model.state_dict())
    hf.save_pretrained(folder)  # copies modeling_attnres.py and writes auto_map
    if tok.name == "bytes":
        _save_byte_tokenizer(folder, prefix, model.config.max_seq_len)
    else:
        _save_gpt2_tokenizer(folder, tok, model.config.max_seq_len)


def check_folder(model, folder: Path) -> None:
    """Reload `folder` as a user would and compare its logits with the model's (float32, LOGITS_ATOL)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32).eval()
    n = min(16, model.config.max_seq_len)
    idx = torch.arange(n).remainder(model.config.vocab_size)[None]
    with torch.no_grad():
        want, got = model(idx)[0], hf(idx).logits
    if not torch.allclose(got, want, rtol=0, atol=LOGITS_ATOL):
        raise ExportError(f"{folder}: the reloaded model's logits differ from the run's by "
                          f"{float((got - want).abs().max()):.3g} > {LOGITS_ATOL}; nothing was written")


def _save_byte_tokenizer(folder: Path, prefix: int, max_len: int) -> None:
    from .hf.tokenization_attnres import AttnResByteTokenizer

    AttnResByteTokenizer.register_for_auto_class("AutoTokenizer")
    AttnResByteTokenizer(bos_token=chr(prefix), model_max_length=max_len).save_pretrained(folder)


def _save_gpt2_tokenizer(folder: Path, tok, max_len: int) -> None:
    """tiktoken's GPT-2 encoding converted to a `tokenizers` tokenizer.json (no download beyond tiktoken's)."""
    import base64

    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    enc = tok._enc
    with tempfile.TemporaryDirectory(prefix="attnres-gpt2-") as tmp:
        # tiktoken's own file format (transformers' helper for it wants the blobfile package)
        ranks = Path(tmp) / "gpt2.tiktoken"
        ranks.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in enc._mergeable_ranks.items()))
        specials = list(enc._special_tokens)  # the argument's name changed in transformers 5
        backend = TikTokenConverter(vocab_file=str(ranks), pattern=enc._pat_str, extra_special_tokens=specials,
                                    additional_special_tokens=specials).converted()
        fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                       eos_token="<|endoftext|>", clean_up_tokenization_spaces=False,
                                       model_max_length=max_len)
    fast.save_pretrained(folder)


def _plain(dataclass_obj) -> dict:
    import dataclasses

    return dataclasses.asdict(dataclass_obj)


def _project_version() -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version("attnres")
    except importlib.metadata.PackageNotFoundError:
        return None


def _tracking_uri(uri: Optional[str]) -> str:
    from attnres.io import absolute_sqlite, default_tracking_uri

    return absolute_sqlite(uri) if uri else default_tracking_uri()


if __name__ == "__main__":
    sys.exit(main())
