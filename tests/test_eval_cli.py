"""`python -m evaluation`: held-out metrics, the probe, lm-eval tasks, and results in the MLflow run."""
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attnres
from attnres import DecoderLM, ModelConfig, ResidualConfig
from evaluation.cli import main

mlflow = pytest.importorskip("mlflow")
ROOT = Path(__file__).resolve().parents[1]
SEQ = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint whose config names a small text corpus, logged as an MLflow run."""
    tmp = tmp_path_factory.mktemp("evalcli")
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the value of x{i % 7} is {i * i % 97}\n" for i in range(700)))
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(d_model=32, layers=2, n_heads=2, max_seq_len=64), ResidualConfig(name="block", block_size=2))
    ck = tmp / "ck"
    attnres.save_pretrained(model, ck, extra={"data": {"name": "text", "path": str(corpus)},
                                                "train": {"seq_len": SEQ, "micro_batch_size": 4, "eval_batches": 2}})
    uri = f"sqlite:///{tmp}/mlflow.db"
    client = mlflow.tracking.MlflowClient(uri)
    # Artifacts under tmp: the default artifact root is ./mlruns in the working directory.
    run = client.create_run(client.create_experiment("eval-test", artifact_location=(tmp / "artifacts").as_uri()))
    client.log_artifacts(run.info.run_id, str(ck), "model")
    client.set_terminated(run.info.run_id)  # a finished training run, as run.py leaves it
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNRES_CACHE", "off")  # the corpus is tokenised afresh, nothing written to ~/.cache
        yield {"tmp": tmp, "ck": ck, "uri": uri, "run_id": run.info.run_id, "model": model.eval(), "corpus": corpus}


def metrics_of(setup):
    return mlflow.tracking.MlflowClient(setup["uri"]).get_run(setup["run_id"]).data.metrics


def artifacts_of(setup, folder):
    client = mlflow.tracking.MlflowClient(setup["uri"])
    return sorted(a.path for a in client.list_artifacts(setup["run_id"], folder))


def test_heldout_loss_and_bits_per_byte_into_the_run(setup, capsys):
    from harness.data import DataConfig, load_data, val_batches

    assert main([setup["run_id"], "--tracking-uri", setup["uri"], "--batch-size", "4"]) == 0
    printed = capsys.readouterr().out
    # The same windows training validates on, scored directly.
    val = load_data(DataConfig(name="text", path=str(setup["corpus"])), SEQ).val
    nats = count = 0
    with torch.no_grad():
        for x, y in val_batches(val, 4, SEQ):
            logits = setup["model"](x)[0]
            nats += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += y.numel()
    m = metrics_of(setup)
    assert m["eval/heldout/loss"] == pytest.approx(nats / count, rel=1e-5)
    assert m["eval/heldout/bits_per_byte"] == pytest.approx(nats / count / math.log(2), rel=1e-5)  # bytes: 1 token = 1 byte
    assert m["eval/heldout/tokens"] == count
    assert "eval/heldout/loss" in printed
    assert artifacts_of(setup, "eval") == ["eval/heldout.json"]
    run = mlflow.tracking.MlflowClient(setup["uri"]).get_run(setup["run_id"])
    assert run.info.status == "FINISHED"  # evaluating does not reopen the training run


def test_as_training_scores_trainings_validation_set(setup, tmp_path):
    out = tmp_path / "r.json"
    assert main([str(setup["ck"]), "--as-training", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["metrics"]["heldout/tokens"] == 4 * 2 * SEQ  # micro_batch_size × eval_batches


def test_as_training_reads_a_null_micro_batch_as_the_batch_size(setup, tmp_path):
    """train.micro_batch_size null (the default) means batch_size, as training builds its held-out
    set; --as-training refused such runs."""
    import attnres

    ck = tmp_path / "ck"
    attnres.save_pretrained(setup["model"], ck, extra={"data": {"name": "text", "path": str(setup["corpus"])},
                                                       "train": {"seq_len": SEQ, "batch_size": 3, "micro_batch_size": None,
                                                                 "eval_batches": 2}})
    out = tmp_path / "r.json"
    assert main([str(ck), "--as-training", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["metrics"]["heldout/tokens"] == 3 * 2 * SEQ


def test_probe_per_hop_count(setup, tmp_path):
    out = tmp_path / "r.json"
    assert main([str(setup["ck"]), "--probe", "--skip-heldout", "--probe-max-per-hop", "3", "--output", str(out)]) == 0
    got = json.loads(out.read_text())["metrics"]
    assert set(got) == {"multihop/acc", "multihop/acc_hop1", "multihop/acc_hop2", "multihop/acc_hop3", "multihop/acc_hop4"}
    assert all(0.0 <= v <= 1.0 for v in got.values())


TASKS = {
    "tiny_mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
""",
    "tiny_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
    "tiny_generate": """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[label]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
metric_list:
  - metric: exact_match
""",
}


def write_tasks(folder: Path) -> None:
    """Three offline lm-eval tasks over a local JSONL: one per request type the adapter serves."""
    docs = [
        {"question": "line 3: the value of x3 is", "choices": [" 9", " 4"], "label": 0, "text": "line 5: the value of x5 is 25\n"},
        {"question": "line 4: the value of x4 is", "choices": [" 7", " 16"], "label": 1, "text": "line 6: the value of x6 is 36\n"},
        {"question": "line 2: the value of x2 is", "choices": [" 4", " 1"], "label": 0, "text": "line 7: the value of x0 is 49\n"},
    ]
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name, body in TASKS.items():
        head = (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  cache_dir: {folder / 'hf'}\n"
                f"  data_files:\n    test: {data}\ntest_split: test\n")
        (folder / f"{name}.yaml").write_text(head + body)


def test_offline_lm_eval_tasks_end_to_end_into_mlflow(setup, monkeypatch, capsys):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'lm-eval==0.4.13')")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = setup["tmp"] / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    code = main([
        setup["run_id"], "--tracking-uri", setup["uri"], "--skip-heldout", "--tasks", ",".join(TASKS),
        "--include-path", str(tasks), "--bootstrap-iters", "10",
    ])
    assert code == 0, capsys.readouterr().err
    m = metrics_of(setup)
    for key in ("tiny_mc/acc", "tiny_rolling/word_perplexity", "tiny_rolling/bits_per_byte", "tiny_generate/exact_match"):
        assert f"eval/{key}" in m, sorted(m)
    assert 0.0 <= m["eval/tiny_mc/acc"] <= 1.0 and m["eval/tiny_rolling/bits_per_byte"] > 0
    assert "eval/lm_eval.json" in artifacts_of(setup, "eval")
    local = mlflow.artifacts.download_artifacts(run_id=setup["run_id"], artifact_path="eval/lm_eval.json",
                                                dst_path=str(setup["tmp"] / "dl"), tracking_uri=setup["uri"])
    results = json.loads(Path(local).read_text())
    assert results["results"]["tiny_mc"]["acc,none"] == m["eval/tiny_mc/acc"]


@pytest.mark.slow  # in CI's second step (.ci/run): keeps the default run under 10 minutes
def test_lm_eval_cli_wrapper_knows_attnres(setup, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": str(ROOT), "ATTNRES_CACHE": "off"}
    out = subprocess.run(
        [sys.executable, "-m", "evaluation.lm_eval_cli", "--model", "attnres", "--model_args", f"pretrained={setup['ck']}",
         "--tasks", "tiny_mc", "--include_path", str(tasks), "--limit", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tiny_mc" in out.stdout and "acc" in out.stdout


def test_lm_eval_cli_wrapper_says_a_bad_checkpoint_in_one_line(tmp_path, capsys, monkeypatch):
    """A pretrained= that cannot be loaded ended the wrapper with a traceback through lm-eval."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed")
    from evaluation.lm_eval_cli import main as lm_eval_main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tasks(tmp_path)
    with pytest.raises(SystemExit) as stop:
        lm_eval_main(["--model", "attnres", "--model_args", "pretrained=/no/such/checkpoint", "--tasks", "tiny_mc",
                      "--include_path", str(tmp_path), "--device", "cpu"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("lm_eval_cli: /no/such/checkpoint: no such file or folder, and not an "
                                            "MLflow run id (32 hex characters) or runs:/ URI")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/no/such/checkpoint"], "no such file or folder"),
        (["0123456789abcdef0123456789abcdef"], "0123456789abcdef0123456789abcdef"),
        (["{ck}", "--data", "name=nope"], "data.name='nope'"),
        (["{ck}", "--data", "colour=red"], "--data 'colour=red'"),
        (["{ck}", "--data", "val_fraction=abc"], "--data val_fraction='abc': not a valid float"),
        (["{ck}", "--tokenizer", "gpt2"], "--tokenizer gpt2: "),  # named but unusable: no tiktoken, or 50257 ids > 256
        (["{ck}", "--probe", "--data", "name=multihop", "--data", "n_vars=many"], "--data n_vars='many': not a valid int"),
        (["{ck}", "--data", "hops=[1,x]"], "--data hops=[1, 'x']: not a valid List[int]"),
        (["{ck}", "--seq-len", "999"], "max_seq_len=64"),
        (["{ck}", "--skip-heldout"], "nothing to evaluate"),
        (["{ck}", "--log-to", "my-run"], "--log-to 'my-run'"),
        (["{ck}", "--device", "tpu9"], "--device tpu9: not a device name"),
        (["{ck}", "--device", "cuda:99"], "--device cuda:99: "),  # no CUDA, or not 100 devices
        (["0123456789abcdef0123456789abcdef", "--tracking-uri", "http://127.0.0.1:{port}"],
         "--tracking-uri http://127.0.0.1:{port}: no MLflow server answers there"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(setup, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", setup["uri"])
    with socket.socket() as s:  # a port nothing listens on: a tracking server that refuses
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    assert main([a.replace("{ck}", str(setup["ck"])).replace("{port}", port) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message.replace("{port}", port) in err and len(err.splitlines()) == 1 and err.startswith("evaluation: ")


def test_an_output_that_cannot_be_a_file_is_refused_before_evaluating(setup, capsys, tmp_path):
    """It was found only after the evaluation, as a traceback that lost every result."""
    (tmp_path / "afile").write_text("x")
    for bad, message in ((tmp_path, "is a folder"), (tmp_path / "afile" / "r.json", "is a file, not a folder")):
        assert main([str(setup["ck"]), "--output", str(bad)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # nothing was evaluated
        err = captured.err.strip()
        assert err.startswith(f"evaluation: --output {bad}: ") and message in err and len(err.splitlines()) == 1


def test_a_failed_output_write_leaves_no_half_written_file(setup, tmp_path, capsys):
    """A write that fails midway (here: a file size limit of 64 bytes, as a full disk would) is one
    line and exit 1, and leaves no truncated JSON behind; it left the first 64 bytes and a traceback."""
    from harness_testing import file_size_limit

    out = tmp_path / "results" / "r.json"
    with file_size_limit(64):
        code = main([str(setup["ck"]), "--max-batches", "1", "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 1, err[-2000:]
    assert err.startswith(f"evaluation: --output {out}: cannot write") and len(err.splitlines()) == 1, err[-2000:]
    assert list(out.parent.iterdir()) == []


def test_runs_are_read_from_run_pys_store_wherever_the_command_starts(setup, capsys, monkeypatch, tmp_path):
    """Without --tracking-uri or $MLFLOW_TRACKING_URI a run id is looked up where run.py logs
    (<project root>/mlflow.db, here a stand-in root), not in ./mlflow.db of the working folder; a
    store that does not exist is one line and no empty database is left behind."""
    import attnres.io

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(attnres.io, "PROJECT_ROOT", setup["tmp"])  # holds mlflow.db
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([setup["run_id"], "--batch-size", "4"]) == 0
    assert "eval/heldout/loss" in capsys.readouterr().out
    assert list(elsewhere.iterdir()) == []  # nothing read from, or created in, the working folder

    monkeypatch.setattr(attnres.io, "PROJECT_ROOT", tmp_path / "empty")
    assert main([setup["run_id"]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"run {setup['run_id']}: no MLflow store at sqlite:///" in err, err
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "empty").exists()


def test_gpt2_end_of_text_counts_no_bytes():
    """Bits per byte counts each token's bytes: tiktoken gives GPT-2's end of text as the 13
    bytes b"<|endoftext|>", which are not text; it must count 0 (checked with a stub of tiktoken's
    encoding, which this machine may not have)."""
    from evaluation.tokenizer import GPT2Tokenizer

    class Encoding:
        def decode_single_token_bytes(self, i):
            return b"<|endoftext|>" if i == 50256 else b"ab"

    tok = GPT2Tokenizer.__new__(GPT2Tokenizer)
    tok._enc, tok.eot_id, tok.vocab_size = Encoding(), 50256, 50257
    assert tok.token_bytes(50256) == b"" and tok.token_bytes(7) == b"ab" and tok.token_bytes(50300) == b""
    assert tok.label(50256) == "<|endoftext|>"


def test_the_probe_scores_a_model_whose_context_is_one_aligned_example():
    """A model trained on aligned compact rows has max_seq_len = the example length (21 tokens
    here), more than the 1 + 10 positions a prompt takes; one position fewer is refused."""
    from evaluation.probe import probe_metrics
    from harness.data import DataConfig, MultiHopProbe

    cfg = DataConfig(name="multihop", hops=[1, 2], n_vars=4, queries=3, format="compact", aligned=True,
                     val_examples=20)
    probe = MultiHopProbe.from_config(cfg)
    assert (probe.prompt_len, probe.example_len) == (10, 21)
    for length, ok in ((probe.example_len, True), (probe.prompt_len + 1, True), (probe.prompt_len, False)):
        torch.manual_seed(0)
        model = DecoderLM(ModelConfig(d_model=32, layers=2, n_heads=2, max_seq_len=length))
        if ok:
            found = probe_metrics(model, cfg)
            assert set(found) == {"acc_hop1", "acc_hop2", "acc"} and all(0 <= v <= 1 for v in found.values())
        else:
            with pytest.raises(ValueError):
                probe_metrics(model, cfg)


def test_data_of_another_tokenizer_is_one_line_before_the_model_runs(setup, tmp_path, capsys):
    """GPT-2 shards for a byte model: the embedding's IndexError ("index out of range in self",
    exit 1) after the data loaded; now one line naming both vocabularies, exit 2, nothing logged."""
    from harness.data import write_shard

    for split in ("train", "val"):
        write_shard(tmp_path / f"g_{split}_000000.bin", [300, 5, 7] * 200)
    before = metrics_of(setup)
    code = main([setup["run_id"], "--tracking-uri", setup["uri"], "--data", "name=shards", "--data", f"path={tmp_path}",
                 "--data", "vocab_size=50257"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("evaluation:")]  # (MLflow's bar aside)
    assert code == 2 and len(err) == 1 and "token 300" in err[0] and "vocabulary of 256" in err[0], err
    assert metrics_of(setup) == before



def test_a_store_deleted_during_the_evaluation_is_one_line_and_not_recreated(setup, tmp_path, capsys, monkeypatch):
    """MLflow makes an empty SQLite store where a deleted one was, then fails on the missing run:
    the results are printed, one line says why they were not logged, and no store appears."""
    import shutil

    import evaluation.heldout as heldout
    from harness_testing import then_delete

    store = tmp_path / "copy.db"
    shutil.copy(Path(setup["uri"].removeprefix("sqlite:///")), store)
    monkeypatch.setattr(heldout, "heldout_metrics", then_delete(heldout.heldout_metrics, store))
    capsys.readouterr()
    assert main([setup["run_id"], "--tracking-uri", f"sqlite:///{store}", "--batch-size", "4", "--max-batches", "1"]) == 1
    captured = capsys.readouterr()
    said = [l for l in captured.err.splitlines() if l.startswith("evaluation:")]
    assert len(said) == 1 and "is gone" in said[0] and "eval/heldout/loss" in captured.out, said
    assert not store.exists()
