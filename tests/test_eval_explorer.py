"""The depth-map explorer: its data are the model's weights, and the page draws them in a browser."""
import array
import base64
import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnres
from attnres import DecoderLM, ModelConfig, ResidualConfig
from evaluation.explorer import depth_weights, explorer_data, layout, main
from evaluation.tokenizer import ByteTokenizer

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium chromium-driver; .ci/run does)"
)


def tiny(name, layers=2, block_size=2):
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(d_model=32, layers=layers, n_heads=2, max_seq_len=64), ResidualConfig(name=name, block_size=block_size))
    with torch.no_grad():  # non-uniform weights, as after training
        for p in model.residual.parameters():
            p.add_(torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explorer")
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(400)))
    attnres.save_pretrained(tiny("block", layers=3), tmp / "ck", extra={"data": {"name": "text", "path": str(corpus)}})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNRES_CACHE", "off")
        yield tmp / "ck"


def unpack(prompt, rows, cols):
    """The page's decoding, in Python: little-endian uint16 / 65535, laid out (reader, token, source)."""
    values = array.array("H", base64.b64decode(prompt["weights"]))
    if sys.byteorder == "big":
        values.byteswap()
    return (torch.tensor(values.tolist(), dtype=torch.float32) / 65535).view(rows, -1, cols)


@pytest.mark.parametrize("name, block_size", [("block", 2), ("full", 2), ("sliding_window", 2), ("block_multihead", 3)])
def test_data_are_the_models_weights(name, block_size):
    model = tiny(name, layers=3, block_size=block_size)
    ids = list(b"def f(x):\n    return x\n")
    data = explorer_data(model, [("p", ids)], ByteTokenizer(), "t", "s")
    R, C = len(data["rows"]), len(data["cols"])
    want = depth_weights(model, torch.tensor([ids]))[:, 0]
    assert want.shape == (R, len(ids), C)
    torch.testing.assert_close(unpack(data["prompts"][0], R, C), want.float(), atol=1e-4, rtol=0)
    visible = torch.tensor([c == "1" for c in data["visible"]]).view(R, C)
    assert torch.equal(visible, model.residual.visibility())
    assert (want[~visible[:, None, :].expand_as(want)] == 0).all()
    assert data["rows"][-1]["kind"] == "out" and [r["kind"] for r in data["rows"][:2]] == ["attn", "mlp"]
    assert data["prompts"][0]["tokens"][9] == "⏎"


def test_byte_labels_are_distinct():
    """Each byte has its own label in the token strip; space and 0xB7 were both "·", and bytes of
    UTF-8 characters showed as Latin-1 letters."""
    tok = ByteTokenizer()
    labels = [tok.label(i) for i in range(256)]
    assert len(set(labels)) == 256
    assert labels[ord(" ")] == "·" and labels[0xB7] == "\\xb7" and [tok.label(b) for b in "é".encode()] == ["\\xc3", "\\xa9"]


def test_block_boundaries():
    lay = layout(tiny("block", layers=3, block_size=4))  # 6 sublayers, S = 4: blocks 0-3 and 4-5
    assert [c["label"] for c in lay["cols"]] == ["emb", "b1", "b2"]
    assert lay["row_bounds"] == [3, 5]
    lay = layout(tiny("full", layers=3))
    assert lay["row_bounds"] == [1, 3, 5] and lay["cols"][1]["label"] == "A0" and lay["cols"][2]["label"] == "M0"


def test_command_writes_a_page_and_refuses_variants_without_depth_weights(checkpoint, tmp_path, capsys):
    out = tmp_path / "sub" / "depth.html"
    assert main([str(checkpoint), "--out", str(out), "--prompts", "3", "--length", "32", "--text", "x = 1</script>"]) == 0
    page = out.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="depth-data">(.*?)</script>', page, re.S).group(1))
    assert len(data["prompts"]) == 4 and all(len(p["tokens"]) == 32 for p in data["prompts"][:3])
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page  # nothing to fetch
    attnres.save_pretrained(tiny("baseline"), tmp_path / "base")
    capsys.readouterr()
    assert main([str(tmp_path / "base"), "--out", str(tmp_path / "b.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert "'baseline' has no attention over depth" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("device, message", [("tpu9", "not a device name; allowed: cpu, cuda"), ("cuda:99", "allowed: cpu")])
def test_a_device_that_cannot_be_used_is_one_line(checkpoint, tmp_path, capsys, device, message):
    """As the evaluation command says it; the explorer passed torch's own error through."""
    if message == "allowed: cpu" and torch.cuda.is_available():
        message = "CUDA device(s)"
    assert main([str(checkpoint), "--out", str(tmp_path / "d.html"), "--device", device]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"explorer: --device {device}: ") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "d.html").exists()


def test_an_out_that_cannot_be_written_leaves_nothing_half_written(checkpoint, tmp_path, capsys):
    """A folder as --out is one line before the model runs; a write that fails midway (a file size
    limit of 4 KB, as a full disk would) is one line, exit 1, and no truncated page: the first 4 KB
    of the page were left behind."""
    (tmp_path / "afile").write_text("x")
    assert main([str(checkpoint), "--out", str(tmp_path / "afile" / "d.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"explorer: --out {tmp_path / 'afile' / 'd.html'}: ") and "not a folder" in err and len(err.splitlines()) == 1
    from harness_testing import file_size_limit

    out = tmp_path / "pages" / "d.html"
    with file_size_limit(4096):
        code = main([str(checkpoint), "--out", str(out), "--prompts", "1", "--length", "16"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith(f"explorer: {out}: cannot write") and len(err.splitlines()) == 1, err[-2000:]
    assert list(out.parent.iterdir()) == []


HOSTILE = ["</script><script>alert(1)</script>", "<!-- x", "<script>", "a \"quoted\" 'one' & <b>",
           "line\u2028sep\u2029", "__DATA__ __TITLE__", "</SCRIPT >", "-->"]


def test_hostile_prompt_text_reaches_the_page_as_the_same_data(checkpoint, tmp_path):
    """`<!--` in a prompt was written as `<\\!--`, which is no JSON escape: the page's data never
    parsed (nor in a browser). The embedded JSON must parse back to the same data, whatever the
    text, and no `</script` or `<!--` may appear inside the data element."""
    from evaluation.explorer_page import render_page

    out = tmp_path / "depth.html"
    args = [str(checkpoint), "--out", str(out), "--prompts", "0"]
    args += [f"--text={text}" for text in HOSTILE]  # (= : "-->" would read as an option)
    assert main(args) == 0
    page = out.read_text()
    inner = re.search(r'<script type="application/json" id="depth-data">(.*?)</script>', page, re.S).group(1)
    assert "<" not in inner and ">" not in inner and "&" not in inner
    data = json.loads(inner)
    assert [p["name"] for p in data["prompts"]] == [f"text: {t[:40]!r}" for t in HOSTILE]
    assert len(re.findall("<script", page)) == 2  # the data element and the page's own code
    # Every value comes back unchanged, and the title is text, not a place to fill.
    data = {"title": "__DATA__ </title><script>", "prompts": [{"name": t} for t in HOSTILE]}
    page = render_page(data)
    inner = re.search(r'id="depth-data">(.*?)</script>', page, re.S).group(1)
    assert json.loads(inner) == data
    assert f"<title>{html.escape(data['title'])}</title>" in page


def test_prompt_names_give_where_in_the_split_each_prompt_starts(checkpoint):
    """The offset in a prompt's name was the window's start before the move to the next line."""
    from evaluation.explorer import validation_prompts
    from evaluation.source import data_settings, open_source
    from harness.data import load_data

    source = open_source(str(checkpoint), device="cpu")
    val = load_data(data_settings(source)[0], 32).val
    prompts = validation_prompts(source, ByteTokenizer(), 4, 32)
    offsets = [int(re.search(r"\(offset (\d+)\)", name).group(1)) for name, _ in prompts]
    for offset, (name, ids) in zip(offsets, prompts):
        assert val[offset : offset + 32].tolist() == ids, name
    assert any(val[o - 1] == ord("\n") for o in offsets if o > 0)  # some prompt did move to a line start


def test_logged_into_the_mlflow_run(checkpoint, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(uri)
    run = client.create_run(client.create_experiment("explorer", artifact_location=(tmp_path / "artifacts").as_uri()))
    client.log_artifacts(run.info.run_id, str(checkpoint), "model")
    assert main([run.info.run_id, "--tracking-uri", uri, "--out", str(tmp_path / "d.html"), "--prompts", "2"]) == 0
    assert [a.path for a in client.list_artifacts(run.info.run_id, "explorer")] == ["explorer/depth.html"]


def test_a_store_deleted_while_the_page_is_made_is_one_line_and_not_recreated(checkpoint, tmp_path, capsys,
                                                                               monkeypatch):
    """MLflow makes an empty SQLite store where a deleted one was, then fails on the missing run:
    the page is kept, one line says why it was not logged, and no store appears."""
    mlflow = pytest.importorskip("mlflow")
    import evaluation.explorer as explorer
    from harness_testing import then_delete

    store = tmp_path / "mlflow.db"
    client = mlflow.tracking.MlflowClient(f"sqlite:///{store}")
    run = client.create_run(client.create_experiment("explorer", artifact_location=(tmp_path / "artifacts").as_uri()))
    client.log_artifacts(run.info.run_id, str(checkpoint), "model")
    monkeypatch.setattr(explorer, "page", then_delete(explorer.page, store))
    capsys.readouterr()
    out = tmp_path / "d.html"
    assert main([run.info.run_id, "--tracking-uri", f"sqlite:///{store}", "--out", str(out), "--prompts", "1"]) == 1
    said = [l for l in capsys.readouterr().err.splitlines() if l.startswith("explorer:")]  # (MLflow's download bar aside)
    assert len(said) == 1 and "is gone" in said[0] and str(out) in said[0], said
    assert out.exists() and not store.exists()


def chromium(tmp_path, url, *extra):
    """Run headless Chromium once; return (stdout, stderr)."""
    args = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr", "--v=0", "--force-device-scale-factor=1", "--window-size=1280,1400",
        *extra, url,
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=90)
    return out.stdout, out.stderr


def console_lines(stderr):
    """The page's console output: Chromium logs every console message and uncaught error as CONSOLE."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def coloured(png, box=None):
    """How many pixels of the (cropped) screenshot are clearly coloured rather than grey or white."""
    from PIL import Image

    image = Image.open(png).convert("RGB")
    if box:
        image = image.crop(box)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(-1, 3).int()
    return int(((pixels.max(1).values - pixels.min(1).values) > 40).sum()), image.size[0] * image.size[1]


@needs_chromium
def test_page_renders_in_headless_chromium(checkpoint, tmp_path):
    page = tmp_path / "depth.html"
    assert main([str(checkpoint), "--out", str(page), "--prompts", "2", "--length", "40"]) == 0
    dom, err = chromium(tmp_path, page.as_uri(), "--dump-dom")
    body = re.search(r"<body([^>]*)>", dom).group(1)
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body))
    assert attrs["ready"] == "1" and attrs["errors"] == "0", attrs
    assert console_lines(err) == []
    assert int(attrs["cells"]) == sum(c == "1" for c in json.loads(
        re.search(r'id="depth-data">(.*?)</script>', page.read_text(), re.S).group(1))["visible"])

    shot = tmp_path / "shot.png"
    _, err = chromium(tmp_path, page.as_uri(), f"--screenshot={shot}")
    assert shot.exists() and console_lines(err) == []
    x, y, w, h = map(int, attrs["heat-rect"].split(","))
    n, area = coloured(shot, (x, y, x + w, y + h))
    # 7 readers x 4 columns, 19 visible: the visible cells are painted in colour.
    assert n > 0.5 * area, f"heat map mostly blank: {n} of {area} pixels coloured"
    n_page, _ = coloured(shot)
    assert n_page > n  # the legend, bars and token strip are drawn too


@needs_chromium
def test_page_works_in_mlflows_sandboxed_iframe(checkpoint, tmp_path):
    """MLflow shows an HTML artifact in <iframe sandbox="allow-scripts">: no storage, no same origin."""
    page = tmp_path / "depth.html"
    assert main([str(checkpoint), "--out", str(page), "--prompts", "1", "--length", "40"]) == 0
    host = tmp_path / "host.html"
    host.write_text(
        '<!DOCTYPE html><html><body style="margin:0"><iframe sandbox="allow-scripts" width="1260" height="1300" '
        f'style="border:0" srcdoc="{html.escape(page.read_text(), quote=True)}"></iframe></body></html>'
    )
    shot = tmp_path / "host.png"
    # The screenshot waits for the page to settle in virtual time, and for every compositor stage
    # of the frame it captures; still, with both cores busy it was taken before the iframe had
    # drawn anything (once in a CI run beside another, once in three default runs of session 19).
    # A later attempt with a longer budget then draws: a page whose script fails in the sandbox
    # draws nothing in any attempt, and says so on the console.
    for budget in (5000, 10000, 20000):
        _, err = chromium(tmp_path, host.as_uri(), f"--screenshot={shot}", f"--virtual-time-budget={budget}",
                          "--run-all-compositor-stages-before-draw")
        assert console_lines(err) == []
        n, _ = coloured(shot)
        if n > 10000:
            break
    assert n > 10000, f"only {n} coloured pixels in three attempts: the page's script did not draw inside the sandbox"


@needs_chromium
def test_the_documented_link_selects_a_row_it_shows(checkpoint, tmp_path):
    """docs/EVALUATION.md's example link, opened on a page: the row it names is the one selected."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "EVALUATION.md").read_text()
    fragment = re.search(r"`depth\.html#([^`]+)`", doc).group(1)
    args = dict(kv.split("=", 1) for kv in fragment.split("&"))
    page = tmp_path / "depth.html"
    assert main([str(checkpoint), "--out", str(page), "--prompts", "2", "--length", "40"]) == 0
    data = json.loads(re.search(r'id="depth-data">(.*?)</script>', page.read_text(), re.S).group(1))
    row = data["rows"][int(args["row"])]
    assert row["kind"] in args["rows"].split(","), f"the link's row {row['label']} is hidden by rows={args['rows']}"
    dom, err = chromium(tmp_path, f"{page.as_uri()}#{fragment}", "--dump-dom")
    assert console_lines(err) == []
    title = re.search(r'id="detail-title">([^<]*)<', dom).group(1)
    assert title.startswith(html.escape(row["title"], quote=False) + " reads "), title
    assert title.endswith("averaged over tokens")
