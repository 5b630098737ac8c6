"""Relufication on tiny synthetic SwiGLU models: the PyTorch layer against the float64 reference,
the relufied file in the engine (logits and exact zeros against the reference with the new
activation), what the L1 penalty and training do, resuming, the pipeline on the output, the
token shard, and bad input (each a clear error, the input model untouched)."""

import hashlib
import json
import sys
import warnings

import numpy as np
import pytest
import torch  # the relufy extra, which scripts/test.sh installs
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from powerinfer_rs import Engine, cli, offline
from powerinfer_rs.offline import packing, torch_model
from powerinfer_rs.offline import relufication as rf
from reference import forward, read_weights, rmsnorm
from synth import write_model

pytestmark = pytest.mark.filterwarnings("ignore:relufy on the CPU")

TEXT = (
    "The river ran past the old mill, and the children counted the boats that drifted by. "
    "In the evening the lamps were lit one by one along the quay, and the fishermen mended their nets. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
)


@pytest.fixture
def corpus(tmp_path):
    """Six training files and one held-out file."""
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(6):
        (d / f"doc{i}.txt").write_text((TEXT + f" Chapter {i}. ") * 8)
    held = tmp_path / "held.txt"
    held.write_text("The lamps along the quay were lit, and the boats drifted by the mill. " * 12)
    return str(d), str(held)


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _settings(**kw):
    base = dict(steps=24, batch=4, seq_len=32, lr=3e-3, l1=0.0, blend=0.25, seed=1)
    base.update(kw)
    return rf.RelufySettings(**base)


def _run(src, corpus, out, **kw):
    train, held = corpus
    settings = kw.pop("settings", None) or _settings()
    kw.setdefault("outtype", "f32")
    return rf.relufy(
        src,
        [train],
        str(out),
        settings,
        eval_paths=[held],
        eval_tokens=256,
        progress=False,
        threads=1,
        **kw,
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(arch="llama"),
        dict(arch="qwen2", bias=True),
        dict(arch="qwen3"),
        dict(arch="llama", rope_freqs=True, tied=True),
        dict(arch="llama", rope_scaling=2.0, dtype=Q.Q4_K, n_embd=256, n_ff=256),
        dict(arch="llama", head_dim=24, n_head_kv=1),
    ],
    ids=["llama", "qwen2-bias", "qwen3", "llama3-factors-tied", "linear-q4k", "gqa-head24"],
)
def test_torch_layer_equals_the_float64_reference(tmp_path, kw):
    """The training model is the engine's function: in float64 it gives the reference's logits
    for the original SwiGLU, for ReGLU and for dReLU."""
    path = write_model(tmp_path / "m.gguf", **{"n_embd": 64, "n_ff": 96, "seed": 3, **kw})
    _, _, cfg, tensors, fixed = rf._load_source(path)
    net = torch_model.build(torch, cfg, tensors, fixed).double()
    w, meta = read_weights(path)
    ids = list(range(3, 43))
    for blend, act in ((0.0, "reglu"), (1.0, "reglu"), (1.0, "dreglu")):
        got = net(torch.tensor([ids]), blend=blend, activation=act)[0].detach().numpy()
        ref = forward(w, meta, ids, activation=None if blend == 0 else act)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-9 * np.abs(ref).max())


@pytest.mark.parametrize("activation", ["reglu", "dreglu"])
def test_relufied_file_runs_in_the_engine_with_zeros_where_the_activation_says(
    tmp_path, corpus, activation
):
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, dtype=Q.Q8_0, seed=2)
    before = _digest(src)
    out = tmp_path / "r.gguf"
    r = _run(src, corpus, out, settings=_settings(activation=activation))
    assert _digest(src) == before
    assert r["activation"] == activation and r["train_tokens"] == 24 * 4 * 32
    assert len(r["sparsity_per_layer"]) == 2 and 0.2 < r["sparsity"] < 1.0
    assert r["eval_text"] == [corpus[1]]
    assert json.load(open(r["report"]))["sparsity"] == r["sparsity"]

    e = Engine.load(str(out), device="cpu", n_ctx=128, kv_type="f32")
    assert e.config["ffn_activation"] == activation
    w, meta = read_weights(str(out))
    ids = e.tokenize(TEXT)[:48]
    ref = forward(w, meta, ids)  # the activation the file names
    np.testing.assert_allclose(e.logits(ids), ref, rtol=0, atol=2e-3 * np.abs(ref).max())
    # the reference with SiLU is another function: the file really is ReLU-family
    assert np.abs(forward(w, meta, ids, activation="swiglu") - ref).max() > 1e-2 * np.abs(ref).max()

    # requantized for users: the same function up to Q8_0's rounding, the activation kept
    q8 = offline.requantize(str(out), str(tmp_path / "r.q8_0.gguf"), "q8_0")
    e8 = Engine.load(q8, device="cpu", n_ctx=128, kv_type="f32")
    assert e8.config["ffn_activation"] == activation
    w8, meta8 = read_weights(q8)
    ref8 = forward(w8, meta8, ids, int8_activations=True)
    got = e8.logits(ids).astype(np.float64)
    assert np.linalg.norm(got - ref8) / np.linalg.norm(ref8) < 2e-3
    assert np.linalg.norm(ref8 - ref) / np.linalg.norm(ref) < 0.1

    # the engine's FFN activations are nonzero exactly where the float64 gate (and up) say
    p = offline.profile(
        e, [corpus[1]], tokens=100, train_tokens=100, window=64, plot=False, progress=False
    )
    for l in range(2):
        h = rmsnorm(p["train_x"][l].astype(np.float64), w[f"blk.{l}.ffn_norm.weight"], 1e-5)
        gate, up = h @ w[f"blk.{l}.ffn_gate.weight"].T, h @ w[f"blk.{l}.ffn_up.weight"].T
        fires = gate > 0 if activation == "reglu" else (gate > 0) & (up > 0)
        clear = (
            np.abs(gate) > 1e-2
            if activation == "reglu"
            else (np.abs(gate) > 1e-2) & (np.abs(up) > 1e-2)
        )
        labels = np.unpackbits(p["train_labels"][l], axis=-1, count=96).astype(bool)
        assert (labels[clear] == fires[clear]).mean() > 0.999


def test_the_l1_penalty_raises_the_zero_share_and_training_lowers_the_kl(tmp_path, corpus):
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, seed=4)
    plain = _run(src, corpus, tmp_path / "a.gguf", settings=_settings(l1=0.0))
    sparse = _run(src, corpus, tmp_path / "b.gguf", settings=_settings(l1=10.0, l1_full=0.25))
    assert sparse["sparsity"] > plain["sparsity"] + 0.02, (plain["sparsity"], sparse["sparsity"])
    # distillation alone from the bare swap: the first point of the curve is the swapped
    # model before any step, and training brings it back toward the teacher
    kl_only = _run(
        src,
        corpus,
        tmp_path / "c.gguf",
        settings=_settings(steps=40, blend=0.0, ce_weight=0.0, lr=3e-4, warmup=0.0),
    )
    curve = kl_only["curve"]
    assert curve[0]["step"] == 0 and curve[-1]["step"] == 40
    assert curve[-1]["kl"] < 0.7 * curve[0]["kl"], [c["kl"] for c in curve]
    assert kl_only["kl_original"] == 0 and 0 < kl_only["kl_relufied"] < curve[0]["kl"]


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, corpus):
    """Batches come from (seed, step) and the optimizer state is checkpointed, so on the CPU the
    resumed run computes the same floats in the same order: equal bit for bit."""
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, seed=5)
    whole = _run(src, corpus, tmp_path / "whole.gguf", settings=_settings(l1=0.5))
    part = _run(src, corpus, tmp_path / "part.gguf", settings=_settings(l1=0.5), max_steps=10)
    assert part["step"] == 10 and not (tmp_path / "part.gguf").exists()
    done = _run(
        src, corpus, tmp_path / "part.gguf", settings=_settings(l1=0.5), resume=part["checkpoint"]
    )
    a, _ = read_weights(str(tmp_path / "whole.gguf"))
    b, _ = read_weights(str(tmp_path / "part.gguf"))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)

    def numbers(curve):  # all but the wall-clock minutes
        return [{k: v for k, v in point.items() if k != "minutes"} for point in curve]

    assert (
        numbers(done["curve"]) == numbers(whole["curve"]) and done["sparsity"] == whole["sparsity"]
    )
    # a checkpoint resumes only under its own settings
    with pytest.raises(ValueError, match="other settings: l1 0.5 there, 0.0 now"):
        _run(
            src, corpus, tmp_path / "x.gguf", settings=_settings(l1=0.0), resume=part["checkpoint"]
        )


def test_a_compiled_student_trains_as_the_eager_one(tmp_path, corpus):
    """torch.compile (on CUDA by default, here asked for on the CPU) traces the student, in
    float and training for a Q4_0 file, with no fallback to eager training. In float the
    learning curve is the eager one to float32 rounding (the compiled kernels fuse and reorder
    sums); for Q4_0 such a difference flips a few weights' 4-bit rounding, a whole step each,
    so there the curve is held to a few percent."""
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, seed=3)
    for qat, rel in (("", 1e-3), ("q4_0", 0.1)):
        settings = _settings(steps=4, l1=0.5, qat=qat)
        outtype = qat or "f32"
        eager = _run(src, corpus, tmp_path / "e.gguf", settings=settings, outtype=outtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = _run(
                src, corpus, tmp_path / "c.gguf", settings=settings, outtype=outtype, compile=True
            )
        assert not [w for w in caught if "torch.compile" in str(w.message)], [
            str(w.message) for w in caught
        ]
        for a, b in zip(eager["curve"], compiled["curve"], strict=True):
            for key in ("ppl", "kl", "zero_share"):
                assert b[key] == pytest.approx(a[key], rel=rel), (qat, key, a, b)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_fake_quantization_is_the_files_rounding(qtype):
    """The student's fake quantization equals the gguf package's quantize-then-dequantize (its
    port of llama.cpp's reference rounding, the scale in f16) on random rows, rows with exact
    zeros and ties, and an all-zero block; the gradient passes straight through."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((6, 96)).astype(np.float32) * np.float32(0.05)
    w[1, :32] = 0.0  # an all-zero block
    w[2, ::3] = 0.0
    w[3, :32] = np.float32(0.25) * np.arange(-16, 16, dtype=np.float32) / 16  # values on a grid
    w[4] *= 1e4  # scales far from 1
    kind = getattr(Q, qtype.upper())
    want = gguf_quants.dequantize(gguf_quants.quantize(w, kind), kind).reshape(w.shape)
    t = torch.from_numpy(w).requires_grad_()
    got = torch_model.fake_quantize(torch, t, qtype)
    np.testing.assert_array_equal(got.detach().numpy(), want)
    got.sum().backward()
    np.testing.assert_array_equal(t.grad.numpy(), np.ones_like(w))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantization_aware_training_writes_the_weights_it_trained(tmp_path, corpus, qtype):
    """With qat the student reads its weights as the file will hold them, so the file holds
    what was trained: its tensors are the fake quantization of the final float weights (the
    checkpoint's), each in the type the file stores it in (Q8_0 for the tied embeddings under
    Q4_0); the student with fake quantization gives the file's logits (float64 reference on the
    file) and without it does not; and training took another path than in float."""
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, seed=3)
    out = tmp_path / "q.gguf"
    _run(src, corpus, out, settings=_settings(qat=qtype, steps=12), outtype=qtype)
    ck = torch.load(str(out) + ".ckpt", map_location="cpu", weights_only=False)
    assert ck["settings"]["qat"] == qtype
    held, meta = read_weights(str(out))
    source, _ = read_weights(src)
    _, _, cfg, tensors, fixed = rf._load_source(src)
    stored = {n: t for n, v in tensors.items() if (t := rf._stored_type(n, v, qtype))}
    assert stored["token_embd.weight"] == ("q8_0" if qtype == "q4_0" else qtype)
    moved = 0
    for key, w in ck["student"].items():
        name = key.removeprefix("w.").replace("__", ".")
        if name in stored:
            want = torch_model.fake_quantize(torch, w, stored[name]).numpy()
            np.testing.assert_array_equal(held[name], want, err_msg=name)
            moved += int((held[name] != source[name]).sum())
    assert moved > 0  # training moved weights across rounding steps
    net = torch_model.build(torch, cfg, tensors, fixed)
    net.load_state_dict(ck["student"])
    ids = list(range(3, 43))
    ref = forward(held, meta, ids)
    scale = np.abs(ref).max()

    def logits():
        return net(torch.tensor([ids]), blend=1.0, activation="reglu")[0].detach().double().numpy()

    net.fake_quant = stored
    np.testing.assert_allclose(logits(), ref, rtol=0, atol=1e-4 * scale)
    net.fake_quant = {}
    assert np.abs(logits() - ref).max() > 1e-3 * scale
    # the same run in float ends at other weights
    _run(src, corpus, tmp_path / "f.gguf", settings=_settings(steps=12), outtype="f16")
    plain = torch.load(str(tmp_path / "f.gguf") + ".ckpt", map_location="cpu", weights_only=False)
    assert any(not torch.equal(plain["student"][k], v) for k, v in ck["student"].items())
    # a 4-bit file without it: a warning that names the cure
    with pytest.warns(UserWarning, match=r"loses most of the training.*--qat"):
        _run(src, corpus, tmp_path / "w.gguf", settings=_settings(steps=2), outtype="q4_0")
    # a type the output is not: refused before any work
    with pytest.raises(ValueError, match="qat 'q4_0' needs outtype 'q4_0', not 'f16'"):
        _run(src, corpus, tmp_path / "x.gguf", settings=_settings(qat="q4_0"), outtype="f16")
    with pytest.raises(ValueError, match="qat must be"):
        _run(src, corpus, tmp_path / "x.gguf", settings=_settings(qat="q5_0"))


def test_a_time_budget_sets_the_step_count(tmp_path, corpus):
    """--minutes: trial steps are timed and undone, then as many steps as fit; the report and
    the checkpoint carry the count chosen, and the trial steps leave no trace in the result."""
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, seed=9)
    r = _run(src, corpus, tmp_path / "t.gguf", minutes=0.02)
    steps = r["hyperparameters"]["steps"]
    assert steps >= 1 and r["train_tokens"] == steps * 4 * 32
    again = _run(src, corpus, tmp_path / "u.gguf", settings=_settings(steps=steps))
    a, _ = read_weights(str(tmp_path / "t.gguf"))
    b, _ = read_weights(str(tmp_path / "u.gguf"))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert again["sparsity"] == r["sparsity"]
    with pytest.raises(ValueError, match="minutes must be a positive number"):
        _run(src, corpus, tmp_path / "v.gguf", minutes=-1)


def test_the_pipeline_runs_on_the_relufied_model(tmp_path, corpus):
    """relufy -> profile -> train-predictors -> convert -> predictor-mode decode, by the CLI."""
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=128, dtype=Q.F16, seed=6)
    out = str(tmp_path / "r.gguf")
    train, held = corpus
    assert (
        cli.main(
            [
                "relufy",
                src,
                "--corpus",
                train,
                "--eval",
                held,
                "-o",
                out,
                "--steps",
                "16",
                "--batch",
                "4",
                "--seq-len",
                "32",
                "--lr",
                "3e-3",
                "--outtype",
                "q8_0",
                "--eval-tokens",
                "128",
                "-t",
                "1",
                "-q",
            ]
        )
        == 0
    )
    prof = str(tmp_path / "r.profile.npz")
    assert (
        cli.main(
            [
                "profile",
                out,
                "--corpus",
                train,
                "--tokens",
                "1200",
                "--train-tokens",
                "1200",
                "--window",
                "128",
                "-o",
                prof,
                "-q",
                "--no-plot",
            ]
        )
        == 0
    )
    preds = str(tmp_path / "r.predictors.npz")
    assert (
        cli.main(
            [
                "train-predictors",
                prof,
                "-o",
                preds,
                "--hidden",
                "128",
                "--epochs",
                "30",
                "--lr",
                "5e-3",
                "-q",
            ]
        )
        == 0
    )
    pw = str(tmp_path / "r.pwri.gguf")
    assert cli.main(["convert", out, preds, "-o", pw]) == 0
    e = Engine.load(pw, predictor_recall=True)
    assert e.config["ffn_activation"] == "reglu" and e.sparsity == "predictor"
    e.generate("the thin hen", max_tokens=8)
    assert e.last_stats["ffn_sparsity"] > 0.2 and e.last_stats["predictor_recall"] > 0.7


def test_pack_keeps_held_out_files_apart(tmp_path, corpus):
    train, held = corpus
    src = write_model(tmp_path / "m.gguf")
    e = Engine.load(src, device="cpu")
    shard_path = str(tmp_path / "s.npz")
    assert cli.main(["pack", src, "--corpus", train, held, "--eval", held, "-o", shard_path]) == 0
    s = packing.load_shard(shard_path, e.tokenizer)
    assert s["train"].dtype == np.uint16 and s["meta"]["split"] == "by file"
    assert held not in s["meta"]["train_files"] and s["meta"]["eval_files"] == [held]
    held_ids = e.tokenizer.encode(open(held).read(), add_bos=False)
    np.testing.assert_array_equal(s["eval"][: len(held_ids)], held_ids)
    assert len(s["train"]) == sum(
        len(e.tokenizer.encode(open(f).read(), add_bos=False)) + 1 for f in s["meta"]["train_files"]
    )
    # a shard trains like its text
    r = rf.relufy(
        src,
        [shard_path],
        str(tmp_path / "r.gguf"),
        _settings(steps=4),
        eval_tokens=64,
        progress=False,
    )
    assert r["corpus"]["train_tokens"] == len(s["train"])
    # without --eval, whole files are held out by a hash of their names
    auto = packing.pack(e.tokenizer, [train], eval_fraction=0.3)
    assert auto["meta"]["eval_files"] and not set(auto["meta"]["eval_files"]) & set(
        auto["meta"]["train_files"]
    )
    # HTML pages are read as the text a reader sees
    page = tmp_path / "page.html"
    page.write_text(
        "<html><head><title>T</title><style>p {}</style></head><body><nav>Home | Next</nav>"
        "<p>The river ran&nbsp;past &amp; the mill.</p><script>var x = 1;</script><p>Boats.</p></body></html>"
    )
    text = packing.read_text(page)
    assert "The river ran\xa0past & the mill." in text and "Boats." in text
    assert "var x" not in text and "Home" not in text and "p {}" not in text
    # a shard of another vocabulary is refused
    s["meta"]["tokenizer"] = "0" * 16
    np.savez(
        tmp_path / "bad.npz",
        train=s["train"],
        eval=s["eval"],
        meta=np.frombuffer(json.dumps(s["meta"]).encode(), np.uint8),
    )
    with pytest.raises(ValueError, match="another vocabulary"):
        packing.load_shard(str(tmp_path / "bad.npz"), e.tokenizer)
    (tmp_path / "junk.npz").write_bytes(b"PK not really")
    with pytest.raises(ValueError, match="not a token shard"):
        packing.load_shard(str(tmp_path / "junk.npz"))


def test_bad_input_is_a_clear_error_and_leaves_the_model_alone(
    tmp_path, corpus, monkeypatch, capsys
):
    train, held = corpus
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, seed=7)
    before = _digest(src)
    out = tmp_path / "r.gguf"

    def run(path=src, c=(train,), o=out, **kw):
        return rf.relufy(
            str(path),
            list(c),
            str(o),
            kw.pop("settings", _settings(steps=4)),
            eval_paths=[held],
            eval_tokens=64,
            progress=False,
            **kw,
        )

    with pytest.raises(
        ValueError,
        match="supports the architectures llama, mistral, qwen2, qwen3; this model is 'gemma'",
    ):
        run(write_model(tmp_path / "g.gguf", arch="gemma"))
    with pytest.raises(ValueError, match="already has a reglu FFN"):
        run(write_model(tmp_path / "relu.gguf", activation="relu"))
    with pytest.raises(ValueError, match="PowerInfer GGUF"):
        run(write_model(tmp_path / "p.gguf", magic=b"PWRI"))
    with pytest.raises(FileNotFoundError, match="model file"):
        run(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="corpus path"):
        run(c=[str(tmp_path / "nothing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        run(c=[str(tmp_path / "empty")])
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ValueError, match="fewer than one batch"):
        run(c=[str(tmp_path / "short.txt")])
    with pytest.raises(OSError, match="cannot write the output"):
        run(o=tmp_path / "no" / "such" / "dir.gguf")
    with pytest.raises(ValueError, match="overwrite the input"):
        run(o=src)
    with pytest.raises(ValueError, match="activation must be"):
        run(settings=_settings(activation="gelu"))
    with pytest.raises(ValueError, match="blend is a share"):
        run(settings=_settings(blend=1.5))
    # a checkpoint of another model
    other = write_model(tmp_path / "other.gguf", n_embd=64, n_ff=96, seed=8)
    part = run(other, max_steps=2)
    with pytest.raises(ValueError, match="another model file"):
        run(resume=part["checkpoint"])
    (tmp_path / "junk.ckpt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a relufy checkpoint"):
        run(resume=str(tmp_path / "junk.ckpt"))
    assert _digest(src) == before and not out.exists()

    # without PyTorch the message names the extra, in Python and on the command line
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"pip install 'powerinfer-rs\[relufy\]'"):
        run()
    assert cli.main(["relufy", src, "--corpus", train, "-o", str(out)]) == 2
    assert "powerinfer-rs[relufy]" in capsys.readouterr().err
    assert _digest(src) == before
