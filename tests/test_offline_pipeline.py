"""The offline toolchain on tiny synthetic models: profiler labels against the float64 reference,
predictor training on a rule it can learn exactly, the converter's layout and logits (from GGUF
and from a safetensors folder), and the whole CLI pipeline."""

import json
import shutil

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from powerinfer_rs import Engine, _core, cli, offline, placement
from powerinfer_rs.offline import training
from reference import read_weights, rmsnorm
from synth import tiny_vocab, write_model

TEXT = (
    "The river ran past the old mill, and the children counted the boats that drifted by. "
    "In the evening the lamps were lit one by one along the quay, and the fishermen mended their nets. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
) * 12


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(TEXT)
    return str(p)


def _random_predictors(n_layer, n_embd, n_ff, hidden=32, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "fc1": [
            rng.standard_normal((hidden, n_embd)).astype(np.float32) * 0.2 for _ in range(n_layer)
        ],
        "fc2": [
            rng.standard_normal((n_ff, hidden)).astype(np.float32) * 0.2 for _ in range(n_layer)
        ],
        "thresholds": np.linspace(-0.5, 0.5, n_layer).astype(np.float32),
    }


def _plain_copy(path, tmp_path):
    """A copy with the GGUF magic, for the gguf package's reader."""
    plain = tmp_path / "plain_copy.gguf"
    shutil.copy(path, plain)
    with open(plain, "r+b") as fh:
        fh.write(b"GGUF")
    return gguf.GGUFReader(str(plain))


def test_profile_labels_match_reference(tmp_path, corpus):
    """ReGLU model: a neuron fires iff relu(gate) * up != 0, i.e. gate > 0. The labels the
    profiler saves agree with gate signs recomputed in float64 from the captured inputs, and the
    counts are the column sums of the labels."""
    path = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, activation="relu", dtype=Q.F32)
    p = offline.profile(
        Engine.load(path, n_ctx=64, device="cpu"),
        corpus,
        tokens=300,
        train_tokens=300,
        window=64,
        output=str(tmp_path / "p.npz"),
        plot=str(tmp_path / "p.png"),
        progress=False,
    )
    assert p["n_tokens"] == 300 and p["activation"] == "reglu"
    assert (tmp_path / "p.png").stat().st_size > 1000
    w, meta = read_weights(path)
    n_ff = 96
    for l in range(2):
        x = p["train_x"][l].astype(np.float64)  # (N, n_embd), the residual entering the FFN
        h = rmsnorm(x, w[f"blk.{l}.ffn_norm.weight"], 1e-5)
        gate = h @ w[f"blk.{l}.ffn_gate.weight"].T
        labels = np.unpackbits(p["train_labels"][l], axis=-1, count=n_ff).astype(bool)
        clear = np.abs(gate) > 1e-2  # the inputs were stored as float16
        assert (labels[clear] == (gate[clear] > 0)).mean() > 0.999
        np.testing.assert_array_equal(p["counts"][l], labels.sum(axis=0))
    q = offline.load_profile(str(tmp_path / "p.npz"))
    np.testing.assert_array_equal(q["counts"], p["counts"])


def test_profile_swiglu_labels_follow_target(tmp_path, corpus):
    path = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, dtype=Q.F32)
    p = offline.profile(
        Engine.load(path, n_ctx=64, device="cpu"),
        corpus,
        tokens=400,
        train_tokens=100,
        window=64,
        target_sparsity=0.7,
        output=str(tmp_path / "p.npz"),
        plot=False,
        progress=False,
    )
    fired = p["counts"].sum() / (p["n_tokens"] * 96 * 2)
    assert abs(fired - 0.3) < 0.05
    assert p["train_x"].shape == (2, 100, 64)


def test_profile_bad_input(tmp_path, corpus):
    path = write_model(tmp_path / "m.gguf")
    engine = Engine.load(path, n_ctx=256, device="cpu")
    with pytest.raises(FileNotFoundError, match="corpus"):
        offline.profile(engine, str(tmp_path / "nope.txt"), tokens=100, plot=False)
    with pytest.raises(ValueError, match="tokens"):
        offline.profile(engine, corpus, tokens=1, plot=False)
    with pytest.raises(ValueError, match="target_sparsity"):
        offline.profile(engine, corpus, tokens=100, target_sparsity=1.5, plot=False)
    with pytest.raises(ValueError, match="window 256 is longer than the engine's context"):
        offline.profile(Engine.load(path, n_ctx=64, device="cpu"), corpus, tokens=100, plot=False)
    with pytest.raises(ValueError, match="sparsity='dense'"):
        offline.profile(
            Engine.load(path, n_ctx=256, device="cpu", sparsity="threshold"),
            corpus,
            tokens=100,
            plot=False,
        )
    with pytest.raises(FileNotFoundError, match="profile"):
        offline.load_profile(str(tmp_path / "missing.npz"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="profile"):
        offline.load_profile(str(tmp_path / "junk.npz"))


def test_training_learns_a_learnable_rule():
    """Labels y = (V x > 0): an MLP of hidden 2d represents this exactly (relu(Vx) - relu(-Vx)),
    so a working trainer reaches high recall and nearly the true sparsity on held-out tokens."""
    rng = np.random.default_rng(0)
    n, d, n_ff = 6000, 32, 64
    V = rng.standard_normal((n_ff, d))
    bias_shift = np.concatenate([np.full(48, -1.0), np.full(16, 0.0)])  # most neurons rarely fire
    x = rng.standard_normal((n, d))
    y = x @ V.T + bias_shift * np.sqrt(d) * 0.5 > 0
    # fold the shift into a constant input feature, as a residual stream's outlier dimension does
    x[:, 0] = 3.0
    V[:, 0] = bias_shift * np.sqrt(d) * 0.5 / 3.0
    y = x @ V.T > 0
    p = {
        "train_x": x.astype(np.float16)[None],
        "train_labels": np.packbits(y, axis=-1)[None],
        "n_ff": n_ff,
        "counts": y.sum(0)[None],
        "n_tokens": n,
        "target_sparsity": float("nan"),
        "model": "synthetic",
    }
    r = offline.train(
        p, recall_target=0.95, hidden=64, epochs=30, lr=5e-3, layers=[0], progress=False
    )
    lr_ = r["layers"][0]
    assert lr_.recall >= 0.95
    assert lr_.predicted_sparsity >= 0.9 * lr_.true_sparsity
    assert lr_.true_sparsity > 0.5
    # the stored predictor reads raw inputs: recompute its logits on everything
    logits = training.predictor_logits(x.astype(np.float32), r["fc1"][0], r["fc2"][0])
    pred = logits >= r["thresholds"][0]
    assert (pred & y).sum() / y.sum() > 0.93


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_predictors_sized_for_the_fewest_bytes(tmp_path, activation):
    """Given the model, a predictor's size is the one that makes a token read the fewest bytes in
    its layer: sizes doubling from min_hidden, stopping at the first that reads more, the fewest
    kept. The bytes: the predictor's weights in the stored type, plus the rows of the neurons it
    keeps - a ReLU model's gate row (the engine skips the up and down rows of a neuron whose gate
    is not positive anyway), a SwiGLU model's gate and up rows and down column - each from the
    gguf package's type sizes."""
    n_embd, n_ff = 64, 96
    path = write_model(
        tmp_path / "m.gguf", n_embd=n_embd, n_ff=n_ff, dtype=Q.Q4_0, activation=activation
    )
    n_layer = Engine.load(path, n_ctx=16).config["n_layer"]
    block, size = gguf.GGML_QUANT_SIZES[Q.Q4_0]
    row = n_embd // block * size  # a Q4_0 row of n_embd: the gate and up rows, a down column
    want_skip = row if activation == "relu" else 3 * row
    for ptype, per_weight in (("f16", 2.0), ("q8_0", 34 / 32), ("f32", 4.0)):
        c = training.predictor_cost(path, ptype)
        assert c.weight_bytes == per_weight and c.skip_bytes == [want_skip] * n_layer
    with pytest.raises(ValueError, match="unknown predictor type 'q5_0'"):
        training.predictor_cost(path, "q5_0")
    # a rule a predictor can learn (see test_training_learns_a_learnable_rule), in every layer
    rng = np.random.default_rng(1)
    n = 3000
    x = rng.standard_normal((n, n_embd))
    x[:, 0] = 3.0
    V = rng.standard_normal((n_ff, n_embd))
    V[:, 0] = -np.sqrt(n_embd) / 6
    y = x @ V.T > 0
    p = {
        "train_x": np.stack([x.astype(np.float16)] * n_layer),
        "train_labels": np.stack([np.packbits(y, axis=-1)] * n_layer),
        "n_ff": n_ff,
        "counts": np.stack([y.sum(0)] * n_layer),
        "n_tokens": n,
        "target_sparsity": float("nan"),
        "model": "m.gguf",
    }
    r = offline.train(
        p,
        recall_target=0.9,
        min_hidden=4,
        epochs=4,
        model=path,
        predictor_type="q8_0",
        progress=False,
        output=str(tmp_path / "p.npz"),
    )
    cost = training.predictor_cost(path, "q8_0")
    for lr_ in r["layers"]:
        t, b = lr_.tried, lr_.tried_bytes
        assert t == [4 * 2**i for i in range(len(t))] and len(b) == len(t)
        assert all(b[i + 1] < b[i] for i in range(len(b) - 2))  # fell until the last
        assert len(t) == 1 or b[-1] >= b[-2] or t[-1] * 2 > 64  # which read more, or the cap
        assert lr_.hidden == t[int(np.argmin(b))]
        assert lr_.relative_bytes == pytest.approx(
            cost.relative_bytes(lr_.layer, lr_.hidden, n_embd, n_ff, lr_.predicted_sparsity)
        )
        assert r["fc1"][lr_.layer].shape == (lr_.hidden, n_embd)
    assert "bytes vs none" in r["table"]


def test_training_in_pytorch_follows_the_numpy_trainer_step_for_step():
    """The PyTorch trainer (`device=`) takes the numpy trainer's initial weights, batches and
    update: on the CPU both give the same predictor up to float32 summation order, and the same
    cut-off, recall and sparsity on held-out tokens. An unknown or absent device is a clear
    error before any work."""
    torch = pytest.importorskip("torch", reason="pip install 'powerinfer-rs[relufy]'")
    torch.set_num_threads(1)
    rng = np.random.default_rng(3)
    n, d, n_ff = 3000, 24, 48
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = (x @ rng.standard_normal((n_ff, d)).T > 1.0).astype(np.float32)
    a = training.fit_layer(x[:2500], y[:2500], 32, epochs=3, lr=5e-3, seed=7)
    b = training.fit_layer(x[:2500], y[:2500], 32, epochs=3, lr=5e-3, seed=7, device="cpu")
    for wa, wb in zip(a, b):
        assert wb.dtype == np.float32 and wb.shape == wa.shape
        assert np.abs(wa - wb).max() <= 1e-3 * np.abs(wa).max()
    # and not merely similar weights: another seed's differ far more
    c = training.fit_layer(x[:2500], y[:2500], 32, epochs=3, lr=5e-3, seed=8, device="cpu")
    assert np.abs(a[0] - c[0]).max() > 0.1 * np.abs(a[0]).max()
    ea, eb = (
        training.evaluate(training.predictor_logits(x[2500:], *w), y[2500:], 0.9) for w in (a, b)
    )
    assert abs(ea["recall"] - eb["recall"]) <= 0.01
    assert abs(ea["predicted_sparsity"] - eb["predicted_sparsity"]) <= 0.01
    p = {
        "train_x": x.astype(np.float16)[None],
        "train_labels": np.packbits(y.astype(bool), axis=-1)[None],
        "n_ff": n_ff,
        "counts": y.sum(0)[None],
        "n_tokens": n,
        "target_sparsity": float("nan"),
    }
    with pytest.raises(ValueError, match="device must be"):
        offline.train(p, device="tpu", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            offline.train(p, device="cuda", progress=False)


def test_training_bad_input():
    p = {
        "train_x": np.zeros((1, 8, 4), np.float16),
        "train_labels": np.zeros((1, 8, 1), np.uint8),
        "n_ff": 8,
        "counts": np.zeros((1, 8)),
        "n_tokens": 8,
        "target_sparsity": 0.5,
    }
    with pytest.raises(ValueError, match="training tokens"):
        offline.train(p, progress=False)
    with pytest.raises(ValueError, match="recall_target"):
        offline.train(p, recall_target=0.0, progress=False)


@pytest.mark.parametrize("dtype,tol", [(Q.F32, 1e-4), (Q.F16, 1e-4), (Q.Q8_0, 0.05)])
def test_convert_gguf_same_dense_logits(tmp_path, dtype, tol):
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, dtype=dtype)
    pred = _random_predictors(2, 64, 96)
    out = offline.convert(src, pred, output=str(tmp_path / "m.pwri.gguf"))
    with open(out, "rb") as fh:
        assert fh.read(4) == b"PWRI"
    a, b = Engine.load(src, sparsity="dense"), Engine.load(out, sparsity="dense")
    assert b.config["powerinfer"] and b.config["has_predictors"] and b.config["has_down_t"]
    assert b.config["ffn_activation"] == "swiglu"  # kept, not PowerInfer's ReGLU default
    toks = a.tokenizer.encode("the thin hen ran in the sand")
    la = a._session().eval(toks, all_logits=True)
    lb = b._session().eval(toks, all_logits=True)
    np.testing.assert_allclose(lb, la, atol=tol * max(1.0, np.abs(la).max()), rtol=0)

    # PowerInfer's layout: predictors first, then the model's tensors with ffn_down_t in place
    r = _plain_copy(out, tmp_path)
    names = [t.name for t in r.tensors]
    assert names[:4] == [
        "blk.0.fc1.weight",
        "blk.0.fc2.weight",
        "blk.1.fc1.weight",
        "blk.1.fc2.weight",
    ]
    src_names = [t.name.replace("ffn_down", "ffn_down_t") for t in gguf.GGUFReader(src).tensors]
    assert names[4:] == src_names
    t = {t.name: t for t in r.tensors}
    assert list(t["blk.0.ffn_down_t.weight"].shape) == [64, 96]  # ggml order: (n_ff rows of n_embd)
    assert list(t["blk.1.fc1.weight"].shape) == [64, 32] and list(t["blk.1.fc2.weight"].shape) == [
        32,
        96,
    ]
    assert t["blk.0.fc1.weight"].tensor_type == Q.F16
    assert t["blk.0.attn_q.weight"].tensor_type == dtype
    assert r.fields["powerinfer.sparse_threshold"].contents() == pytest.approx(
        float(np.median(pred["thresholds"]))
    )
    # the per-layer cut-offs reach predictor mode
    c = Engine.load(out)
    assert c.sparsity == "predictor"
    np.testing.assert_allclose(c.predictor_layer_cutoffs, pred["thresholds"], rtol=1e-6)
    c._session().eval(toks)


def test_convert_outtype_and_bad_input(tmp_path):
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, dtype=Q.F32)
    pred = _random_predictors(2, 64, 96)
    out = offline.convert(
        src, pred, output=str(tmp_path / "q.gguf"), outtype="q8_0", predictor_type="q8_0"
    )
    r = _plain_copy(out, tmp_path)
    t = {t.name: t for t in r.tensors}
    assert t["blk.0.ffn_gate.weight"].tensor_type == Q.Q8_0
    assert t["blk.0.ffn_down_t.weight"].tensor_type == Q.Q8_0
    assert t["blk.0.fc2.weight"].tensor_type == Q.Q8_0
    assert t["blk.0.attn_norm.weight"].tensor_type == Q.F32
    Engine.load(out)._session().eval([5, 6, 7])

    with pytest.raises(ValueError, match="already a PowerInfer"):
        offline.convert(out, pred, output=str(tmp_path / "again.gguf"))
    with pytest.raises(ValueError, match="layers"):
        offline.convert(src, _random_predictors(3, 64, 96), output=str(tmp_path / "x.gguf"))
    with pytest.raises(ValueError, match="fc1"):
        offline.convert(src, _random_predictors(2, 32, 96), output=str(tmp_path / "x.gguf"))
    with pytest.raises(ValueError, match="output type"):
        offline.convert(src, pred, output=str(tmp_path / "x.gguf"), outtype="q3_k")
    with pytest.raises(FileNotFoundError):
        offline.convert(str(tmp_path / "missing.gguf"), pred)
    with pytest.raises(FileNotFoundError, match="predictors"):
        offline.convert(src, str(tmp_path / "missing.npz"))


def _hf_folder(gguf_path, folder):
    """The same weights as a Hugging Face LLaMA checkpoint: safetensors, config.json and a
    byte-level BPE tokenizer.json (q and k back in Hugging Face's rotate-half order)."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    w, meta = read_weights(gguf_path)
    n_head, n_head_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    n_layer, n_embd, n_ff = (
        meta["llama.block_count"],
        meta["llama.embedding_length"],
        meta["llama.feed_forward_length"],
    )

    def unpermute(m, heads):
        rows = m.shape[0]
        return m.reshape(heads, rows // heads // 2, 2, m.shape[1]).swapaxes(1, 2).reshape(m.shape)

    t = {
        "model.embed_tokens.weight": w["token_embd.weight"],
        "model.norm.weight": w["output_norm.weight"],
        "lm_head.weight": w["output.weight"],
    }
    for l in range(n_layer):
        p, q = f"model.layers.{l}.", f"blk.{l}."
        t[p + "input_layernorm.weight"] = w[q + "attn_norm.weight"]
        t[p + "self_attn.q_proj.weight"] = unpermute(w[q + "attn_q.weight"], n_head)
        t[p + "self_attn.k_proj.weight"] = unpermute(w[q + "attn_k.weight"], n_head_kv)
        t[p + "self_attn.v_proj.weight"] = w[q + "attn_v.weight"]
        t[p + "self_attn.o_proj.weight"] = w[q + "attn_output.weight"]
        t[p + "post_attention_layernorm.weight"] = w[q + "ffn_norm.weight"]
        t[p + "mlp.gate_proj.weight"] = w[q + "ffn_gate.weight"]
        t[p + "mlp.up_proj.weight"] = w[q + "ffn_up.weight"]
        t[p + "mlp.down_proj.weight"] = w[q + "ffn_down.weight"]
    folder.mkdir()
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": n_embd,
                "intermediate_size": n_ff,
                "num_hidden_layers": n_layer,
                "num_attention_heads": n_head,
                "num_key_value_heads": n_head_kv,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "max_position_embeddings": 256,
                "hidden_act": "silu",
                "vocab_size": len(tiny_vocab()[0]),
                "bos_token_id": 0,
                "eos_token_id": 2,
                "tie_word_embeddings": False,
            }
        )
    )
    tokens, types, merges = tiny_vocab()
    vocab = {tok: i for i, tok in enumerate(tokens) if types[i] == 1}
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in merges]))
    tj = json.loads(tok.to_str())
    tj["added_tokens"] = [
        {
            "id": i,
            "content": tokens[i],
            "special": True,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
        }
        for i in range(3)
    ]
    (folder / "tokenizer.json").write_text(json.dumps(tj))


def test_convert_safetensors_matches_gguf(tmp_path):
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=96, n_head=4, n_head_kv=2, dtype=Q.F32)
    _hf_folder(src, tmp_path / "hf")
    out = offline.convert(
        str(tmp_path / "hf"),
        _random_predictors(2, 64, 96),
        output=str(tmp_path / "hf.pwri.gguf"),
        outtype="f32",
    )
    a, b = Engine.load(src, sparsity="dense"), Engine.load(out, sparsity="dense")
    assert b.config["powerinfer"] and b.config["ffn_activation"] == "swiglu"
    assert b.tokenizer.tokens == a.tokenizer.tokens
    toks = a.tokenizer.encode("the thin hen ran in the sand")
    la = a._session().eval(toks, all_logits=True)
    lb = b._session().eval(toks, all_logits=True)
    np.testing.assert_allclose(lb, la, atol=1e-4 * np.abs(la).max(), rtol=0)

    (tmp_path / "bad").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        offline.convert(str(tmp_path / "bad"), _random_predictors(2, 64, 96))


def test_cli_pipeline(tmp_path, corpus, capsys):
    """profile -> train-predictors -> convert -> place -> run, through the command line, on a
    ReGLU model (PowerInfer's own kind)."""
    src = write_model(tmp_path / "m.gguf", n_embd=64, n_ff=128, activation="relu", dtype=Q.F16)
    prof = str(tmp_path / "m.profile.npz")
    assert (
        cli.main(
            [
                "profile",
                src,
                "--corpus",
                corpus,
                "--tokens",
                "1200",
                "--train-tokens",
                "1200",
                "--window",
                "128",
                "-o",
                prof,
                "-q",
            ]
        )
        == 0
    )
    assert (tmp_path / "m.profile.npz.png").exists()
    preds = str(tmp_path / "m.predictors.npz")
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
                "40",
                "--lr",
                "5e-3",
                "-q",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "pred_sparsity" in out and (tmp_path / "m.predictors.npz.txt").exists()
    pw = str(tmp_path / "m.pwri.gguf")
    assert cli.main(["convert", src, preds, "-o", pw]) == 0
    # room for both layers' dense parts and KV cache (128 positions), the output and 96 neurons
    mb = placement.model_bytes(pw, 128)
    budget = int(
        sum(mb.layer_dense_bytes) + mb.kv_cache_bytes + mb.output_bytes + 96 * mb.neuron_bytes.max()
    )
    assert (
        cli.main(
            [
                "place",
                pw,
                "--profile",
                prof,
                "--vram-budget",
                str(budget),
                "--group",
                "32",
                "--cpu-bandwidth",
                "5e10",
                "--sync-latency",
                "1e-9",
                "--ctx-size",
                "128",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "solver:" in out
    split = _core.read_gpu_index(pw + ".generated.gpuidx")
    assert len(split["gpu_idx"]) == 2 and split["vram_capacity"] == budget
    assert sum(len(b) for b in split["gpu_bucket"]) == 96
    # the hottest neurons went to the GPU
    p = offline.load_profile(prof)
    for l, bucket in enumerate(split["gpu_bucket"]):
        if len(bucket):
            rest = np.setdiff1d(np.arange(128), bucket)
            assert p["counts"][l][bucket].min() >= p["counts"][l][rest].max()
    e = Engine.load(pw, predictor_recall=True)
    e.generate("the thin hen", max_tokens=8)
    assert e.last_stats["predictor_recall"] > 0.8
    assert e.last_stats["ffn_sparsity"] > 0.2
    assert cli.main(["place", pw, "--profile", prof, "--vram-budget", "1KiB"]) == 1
    assert "too small" in capsys.readouterr().err
