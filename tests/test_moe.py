"""Mixture-of-experts models as llama.cpp writes them (Mixtral as `llama` with experts,
`qwen2moe` with its sigmoid-gated shared expert, `qwen3moe`, `olmoe`, `smallthinker` with its
pre-attention router and ReGLU experts, `gpt-oss` with attention sinks, biased experts and MXFP4),
on tiny random files:
logits against the independent float64 reference (tests/reference.py), a prompt against the
same tokens one at a time and a batch of sessions against each alone (bit for bit), the bytes a
decode token reads, and the bad files and requests each refused with a message naming the
problem."""

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from powerinfer_rs import Engine, ModelError, _core
from reference import forward, read_weights
from synth import write_model
from test_gpu import ON_DEVICES

# ||engine - reference|| / ||reference||, per token: f32 against f64 (float weights) over a
# prompt, and against a reference that rounds activations to int8 as the engine does
# (quantized weights), each token alone, where only float error remains
FLOAT_TOL = 2e-4
QUANT_TOL = 1e-4
# Tokens that came within rounding error of another choice are not comparable: routing whose
# router logits for the last chosen expert and the next differ by less than this (float error,
# or an int8-rounded model's) may pick the other expert, and an activation this near (in int8
# steps) to a rounding tie rounds apart in f32 and f64 (moving that token's logits by ~1%): its
# step x 127 / peak carries the f32 error of x and of the peak, each ~2e-7 relative here (the
# logits of the tokens without a flip, at every SIMD level), so up to 127 x 4e-7 ~ 5e-5 steps
# (seen: ties 2.2e-5 and 3.0e-5 away rounded apart with the scalar kernels, 9.9e-6 with all)
NEAR_ROUTING_TIE = {"float": 1e-3, "int8": 5e-2}
NEAR_ROUNDING_TIE = 5e-5

FAMILIES = {
    # Mixtral: a `llama` file with experts, n_ff wide, the chosen weights normalised
    "mixtral": dict(arch="llama", experts=dict(n_expert=8, n_used=2, ff_key=False)),
    # Qwen2-MoE: attention biases, weights as they are, a shared expert
    "qwen2moe": dict(arch="qwen2moe", bias=True, experts=dict(n_expert=8, n_used=4, shared=True)),
    # Qwen3-MoE: per-head q/k norms, normalised weights, many small experts
    "qwen3moe": dict(arch="qwen3moe", experts=dict(n_expert=16, n_used=4)),
    # OLMoE: q and k normed whole, weights as they are
    "olmoe": dict(arch="olmoe", n_head_kv=4, experts=dict(n_expert=8, n_used=2, ff_key=False)),
    # SmallThinker: the router reads the layer input, ReGLU experts, normalised weights; with
    # a window (4096, llama.cpp's whatever the file says) over three of every four layers, the
    # first of each four without RoPE (its sigmoid gating: test_sigmoid_gating_...)
    "smallthinker": dict(
        arch="smallthinker",
        n_layer=5,
        sliding_window=64,
        # (smaller weights: the residual stream the router reads grows less from layer to
        # layer, as a trained model's does)
        weight_scale=0.5,
        experts=dict(n_expert=8, n_used=2, gating="softmax"),
    ),
    # gpt-oss: attention biases and sinks, every other layer sliding (from the first), YaRN on
    # every layer, a biased router whose chosen logits' softmax weighs the experts, biased
    # experts with the clamped SwiGLU (its MXFP4 experts: test_gpt_oss_mxfp4_experts_...)
    "gpt-oss": dict(
        arch="gpt-oss",
        n_layer=3,
        sliding_window=8,
        rope_scaling=4.0,
        yarn_original_ctx=64,
        experts=dict(n_expert=8, n_used=2),
    ),
}


def write_moe(path, family, dtype=Q.F32, **overrides):
    """`family`'s tiny model in `dtype`; the widths are whole 256-weight super-blocks."""
    kw = dict(FAMILIES[family])
    experts = dict(kw.pop("experts"))
    shared = experts.pop("shared", False)
    experts.update(n_ff_exp=256, n_ff_shared=256 if shared else 0)
    experts.update(overrides.pop("experts", {}))
    kw.update(n_embd=256, n_ff=256, n_head=4, n_head_kv=kw.get("n_head_kv", 2), head_dim=64)
    kw.update(overrides)
    return write_model(path, dtype=dtype, experts=experts, **kw)


def each_token_alone(w, meta, ids, routing, rounding):
    """The reference's logits of each token alone, its activations rounded to int8 as the
    engine's; routing[i] and rounding[i] receive token i's margins to a tie."""
    return np.concatenate(
        [
            forward(
                w,
                meta,
                [t],
                int8_activations=True,
                routing_margin=routing[i : i + 1],
                rounding_margin=rounding[i : i + 1],
            )
            for i, t in enumerate(ids)
        ]
    )


def relative_errors(got, ref):
    return np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


@pytest.mark.parametrize("dtype", [Q.F32, Q.Q4_0, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_float64_reference(tmp_path, family, dtype):
    path = write_moe(tmp_path / "m.gguf", family, dtype)
    model = _core.Model(path, 2)
    ids = np.random.default_rng(1).integers(0, model.config()["n_vocab"], size=40).tolist()
    w, meta = read_weights(path)
    int8 = dtype != Q.F32
    routing = np.full(len(ids), np.inf)
    rounding = np.full(len(ids), np.inf)
    if not int8:
        # a prompt
        ref = forward(w, meta, ids, routing_margin=routing)
        got = _core.Session(model, 64, "f32").eval(ids, all_logits=True)
    else:
        # each token alone
        ids, routing, rounding = ids[:16], routing[:16], rounding[:16]
        ref = each_token_alone(w, meta, ids, routing, rounding)
        got = np.stack([_core.Session(model, 8, "f32").eval([t]) for t in ids])
    comparable = (routing > NEAR_ROUTING_TIE["int8" if int8 else "float"]) & (
        rounding > NEAR_ROUNDING_TIE
    )
    assert comparable.mean() >= 0.5, f"mostly near ties: routing {routing}, rounding {rounding}"
    rel = relative_errors(got, ref)[comparable]
    assert rel.max() < (QUANT_TOL if int8 else FLOAT_TOL), f"relative errors {rel}"
    # the reference tells the routing apart: the same experts, chosen by the least probable
    # instead, are far away
    router = [k for k in w if k.endswith("ffn_gate_inp.weight")]
    flipped = {**w, **{k: -w[k] for k in router}}
    far = relative_errors(got, forward(flipped, meta, ids, int8_activations=int8))
    assert np.median(far) > 100 * QUANT_TOL, f"routing by the least probable is only {far}"


def test_sigmoid_gating_matches_float64_reference(tmp_path):
    """SmallThinker's other router function: each expert's sigmoid, the chosen ones'
    normalised. (Two layers: the layer input the router reads grows layer by layer, and
    sigmoids near 1 tie in float32 where float64 still orders them.)"""
    path = write_moe(
        tmp_path / "m.gguf",
        "smallthinker",
        n_layer=2,
        experts=dict(n_expert=8, n_used=2, gating="sigmoid"),
    )
    model = _core.Model(path, 2)
    assert model.config()["experts"]["gating"] == "sigmoid"
    ids = np.random.default_rng(3).integers(0, model.config()["n_vocab"], size=32).tolist()
    w, meta = read_weights(path)
    routing = np.full(len(ids), np.inf)
    ref = forward(w, meta, ids, routing_margin=routing)
    got = _core.Session(model, 64, "f32").eval(ids, all_logits=True)
    comparable = routing > NEAR_ROUTING_TIE["float"]
    assert comparable.mean() >= 0.5, f"mostly near ties: {routing}"
    rel = relative_errors(got, ref)[comparable]
    assert rel.max() < FLOAT_TOL, f"relative errors {rel}"
    # the softmax of the same logits routes the same experts with other weights: far away
    softmax = forward(w, {**meta, "smallthinker.expert_gating_func": 1}, ids)
    assert np.median(relative_errors(got, softmax)) > 100 * FLOAT_TOL


# every weight type the engine computes with, as the experts' type
ALL_TYPES = [Q[t["name"]] for t in _core.weight_types()]


@pytest.mark.parametrize("dtype", ALL_TYPES, ids=lambda t: t.name)
def test_experts_in_every_weight_type(tmp_path, dtype):
    test_logits_match_float64_reference(tmp_path, "qwen3moe", dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_equals_token_by_token_and_a_batch_equals_each_alone(tmp_path, family):
    path = write_moe(tmp_path / "m.gguf", family, Q.Q4_K)
    model = _core.Model(path, 2)
    ids = np.random.default_rng(2).integers(0, model.config()["n_vocab"], size=24).tolist()
    whole = _core.Session(model, 64, "f32").eval(ids, all_logits=True)
    one = _core.Session(model, 64, "f32")
    steps = np.stack([one.eval([t]) for t in ids])
    np.testing.assert_array_equal(steps, whole)
    # three sessions at different positions, their next tokens as one pass (the rows share
    # experts or not by their own routing)
    prompts = [ids[:5], ids[5:12], ids[12:14]]
    alone = [_core.Session(model, 64, "f32") for _ in prompts]
    batched = [_core.Session(model, 64, "f32") for _ in prompts]
    for p, a, b in zip(prompts, alone, batched):
        a.eval(p)
        b.eval(p)
    for step in range(4):
        nxt = [ids[(7 * i + step) % len(ids)] for i in range(len(prompts))]
        want = np.stack([a.eval([t]) for a, t in zip(alone, nxt)])
        np.testing.assert_array_equal(_core.eval_batch(batched, nxt), want, err_msg=f"step {step}")


@pytest.mark.parametrize("dtype", [Q.Q4_0, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_copied_into_memory_or_mapped_compute_the_same(tmp_path, family, dtype):
    # with AVX2 and up the CPU reads Q4_0 and Q4_K experts from an interleaved copy of
    # its own, and copying the file into memory leaves them in the file's map for every other
    # reader: the logits are the same bits either way, a prompt's the same as its tokens' one by
    # one, the file as it was
    path = write_moe(tmp_path / "m.gguf", family, dtype)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    mapped, copied = _core.Model(path, 2, False), _core.Model(path, 2, True)
    assert (mapped.in_memory, copied.in_memory) == (False, True)
    ids = np.random.default_rng(5).integers(0, mapped.config()["n_vocab"], size=20).tolist()
    whole = _core.Session(copied, 64, "f32").eval(ids, all_logits=True)
    np.testing.assert_array_equal(
        _core.Session(mapped, 64, "f32").eval(ids, all_logits=True), whole
    )
    one = _core.Session(mapped, 64, "f32")
    np.testing.assert_array_equal(np.stack([one.eval([t]) for t in ids]), whole)
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest


def test_a_decode_token_reads_only_its_experts(tmp_path):
    path = write_moe(tmp_path / "m.gguf", "qwen2moe", Q.Q4_0)
    f = _core.GgufFile(path)
    size = {t["name"]: t["n_bytes"] for t in f.tensors()}
    cfg = _core.Model(path, 2).config()
    n_layer, e, k = cfg["n_layer"], cfg["experts"]["n_expert"], cfg["experts"]["n_expert_used"]

    def layer_bytes(names):
        return sum(size[f"blk.{i}.{n}.weight"] for i in range(n_layer) for n in names)

    # (the counters cover every layer matrix: attention's too)
    attention = layer_bytes(["attn_q", "attn_k", "attn_v", "attn_output"])
    always = attention + layer_bytes(
        ["ffn_gate_inp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    )
    experts = layer_bytes(["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"])
    s = _core.Session(_core.Model(path, 2), 32, "f32")
    s.eval([5, 6, 7])
    s.take_stats()
    s.eval([8])
    st = s.take_stats()
    assert st["weight_bytes"] == always + experts
    assert st["weight_bytes_read"] == always + experts * k // e
    n_ff_exp = cfg["experts"]["n_ff_exp"]
    assert st["neurons"] == n_layer * e * n_ff_exp
    assert st["skipped"] == n_layer * (e - k) * n_ff_exp


def test_relu_experts_read_up_rows_only_where_the_gate_is_positive(tmp_path):
    """SmallThinker's ReGLU experts: a decode token reads an up row only for the neurons its
    gate made positive (the others' activation is exactly zero). One layer, float weights: the
    gates are counted from the float64 reference's own FFN input, and the logits stay the
    reference's."""
    path = write_moe(tmp_path / "m.gguf", "smallthinker", Q.F32, n_layer=1, sliding_window=None)
    f = _core.GgufFile(path)
    size = {t["name"]: t["n_bytes"] for t in f.tensors()}
    model = _core.Model(path, 2)
    cfg = model.config()["experts"]
    e, k, ff = cfg["n_expert"], cfg["n_expert_used"], cfg["n_ff_exp"]
    w, meta = read_weights(path)
    token = 9
    # the reference's FFN input for one token at position 0: attention reads only itself
    x = w["token_embd.weight"][[token]]

    def rms(v, g):
        return v / np.sqrt((v * v).mean(axis=1, keepdims=True) + 1e-5) * g

    h = rms(x, w["blk.0.attn_norm.weight"])
    v = h @ w["blk.0.attn_v.weight"].T
    v = np.repeat(v.reshape(1, 2, -1), 2, axis=1).reshape(1, -1)  # 4 heads share 2 kv heads
    x1 = x + v @ w["blk.0.attn_output.weight"].T
    hf = rms(x1, w["blk.0.ffn_norm.weight"])
    routes = []
    ref = forward(w, meta, [token], routes=routes)
    chosen = routes[0][1][0]
    gates = np.concatenate([hf @ w["blk.0.ffn_gate_exps.weight"][c].T for c in chosen], axis=1)
    assert np.abs(gates).min() > 1e-4, "a gate too near zero to count"
    zeroed = int((gates <= 0).sum())
    assert 0 < zeroed < k * ff
    s = _core.Session(model, 8, "f32")
    got = s.eval([token])
    assert relative_errors(got[None], ref).max() < FLOAT_TOL
    st = s.take_stats()
    always = sum(size[f"blk.0.{n}.weight"] for n in ["attn_q", "attn_k", "attn_v", "attn_output"])
    always += size["blk.0.ffn_gate_inp.weight"]
    experts = sum(size[f"blk.0.ffn_{n}_exps.weight"] for n in ["gate", "up", "down"])
    up_row = size["blk.0.ffn_up_exps.weight"] // (e * ff)
    assert st["weight_bytes_read"] == always + experts * k // e - zeroed * up_row


def test_the_engine_runs_a_moe_file_and_reports_its_experts(tmp_path):
    path = write_moe(tmp_path / "m.gguf", "qwen3moe", Q.Q4_0)
    engine = Engine.load(path, threads=2, device="cpu")
    experts = engine._model.config()["experts"]
    assert experts == dict(
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=256,
        n_ff_shared=0,
        normalize_weights=True,
        weights_scale=1.0,
        gating="softmax",
        router_input="ffn_input",
    )
    text = "".join(engine.stream("the", max_tokens=8, temperature=0))
    assert len(text) > 0
    dense = write_model(tmp_path / "d.gguf")
    assert _core.Model(dense, 2).config()["experts"] is None


@pytest.mark.parametrize(
    "what, kwargs, message",
    [
        (
            "no expert used",
            dict(experts=dict(n_used=0)),
            r"expert_used_count = 0 must be between 1 and",
        ),
        (
            "more used than there are",
            dict(experts=dict(n_used=9)),
            r"expert_used_count = 9 must be between 1 and .*expert_count = 8",
        ),
        (
            "an expert tensor missing",
            dict(skip=("blk.1.ffn_up_exps.weight",)),
            r"blk\.1\.ffn_up_exps\.weight is missing",
        ),
        (
            "experts of the wrong width",
            dict(extra_meta={"expert_feed_forward_length": 128}),
            r"blk\.0\.ffn_gate_exps\.weight has shape \[8, 256, 256\], expected \[8, 128, 256\]",
        ),
        (
            "a router of the wrong size",
            dict(extra_meta={"expert_count": 16}, experts=dict(n_used=2)),
            r"blk\.0\.ffn_gate_inp\.weight has shape \[8, 256\], expected \[16, 256\]",
        ),
        (
            "a shared expert missing its gate",
            dict(skip=("blk.0.ffn_gate_inp_shexp.weight",)),
            r"blk\.0\.ffn_gate_inp_shexp\.weight is missing",
        ),
    ],
)
def test_bad_moe_files_name_the_key_or_tensor(tmp_path, what, kwargs, message):
    family = "qwen2moe"
    overrides = dict(kwargs)
    if "experts" in overrides:
        overrides["experts"] = {"n_expert": 8, **overrides["experts"]}
    path = write_moe(tmp_path / "m.gguf", family, Q.Q4_0, **overrides)
    with pytest.raises(ModelError, match=message):
        _core.Model(path, 2)


@pytest.mark.parametrize(
    "gating, message",
    [
        (None, r"smallthinker\.expert_gating_func is missing"),
        (3, r"smallthinker\.expert_gating_func = 3 is not supported \(1: softmax, 2: sigmoid\)"),
    ],
)
def test_a_smallthinker_router_function_missing_or_unknown_is_named(tmp_path, gating, message):
    experts = dict(n_expert=8, n_used=2, gating=gating)
    path = write_moe(tmp_path / "m.gguf", "smallthinker", Q.Q4_0, n_layer=2, experts=experts)
    with pytest.raises(ModelError, match=message):
        _core.Model(path, 2)


def test_an_expert_count_of_zero_is_named(tmp_path):
    path = write_model(tmp_path / "m.gguf", arch="qwen3moe", n_embd=64)
    with pytest.raises(ModelError, match=r"qwen3moe\.expert_count must be > 0"):
        _core.Model(path, 2)


def test_gpt_oss_mxfp4_experts_match_float64_reference(tmp_path):
    """gpt-oss as its files come: MXFP4 experts (the rest Q8_0 here), each token alone against
    the reference that rounds activations to int8; a prompt equals the same tokens one at a
    time, bit for bit, and the experts interleaved in a copy in memory (AVX2 and up) equal the
    file's mapped layout."""
    path = write_moe(tmp_path / "m.gguf", "gpt-oss", Q.Q8_0, experts=dict(dtype=Q.MXFP4))
    types = {t["name"]: t["type"] for t in _core.GgufFile(path).tensors()}
    assert types["blk.0.ffn_down_exps.weight"] == "MXFP4"
    model = _core.Model(path, 2)
    ids = np.random.default_rng(4).integers(0, model.config()["n_vocab"], size=16).tolist()
    w, meta = read_weights(path)
    routing, rounding = np.full(len(ids), np.inf), np.full(len(ids), np.inf)
    ref = each_token_alone(w, meta, ids, routing, rounding)
    got = np.stack([_core.Session(model, 8, "f32").eval([t]) for t in ids])
    comparable = (routing > NEAR_ROUTING_TIE["int8"]) & (rounding > NEAR_ROUNDING_TIE)
    assert comparable.mean() >= 0.5, f"mostly near ties: routing {routing}, rounding {rounding}"
    rel = relative_errors(got, ref)[comparable]
    assert rel.max() < QUANT_TOL, f"relative errors {rel}"
    whole = _core.Session(model, 64, "f32").eval(ids, all_logits=True)
    one = _core.Session(model, 64, "f32")
    np.testing.assert_array_equal(np.stack([one.eval([t]) for t in ids]), whole)
    for in_memory in (False, True):
        other = _core.Model(path, 2, in_memory)
        np.testing.assert_array_equal(
            _core.Session(other, 64, "f32").eval(ids, all_logits=True), whole
        )


def test_each_of_gpt_oss_differences_is_in_the_logits(tmp_path):
    """The reference without any one of gpt-oss's differences (attention sinks, the router's
    bias, the experts' biases, the clamped SwiGLU, the sliding window, YaRN on the sliding
    layers) is far from the engine's logits, which are near the reference with all of them:
    the engine computes each, and none is too small to tell."""
    path = write_moe(tmp_path / "m.gguf", "gpt-oss")
    model = _core.Model(path, 2)
    cfg = model.config()
    assert cfg["experts"]["gating"] == "softmax_of_chosen"
    assert cfg["ffn_activation"] == "swiglu_oai"
    ids = np.random.default_rng(5).integers(0, cfg["n_vocab"], size=32).tolist()
    got = _core.Session(model, 64, "f32").eval(ids, all_logits=True)
    w, meta = read_weights(path)
    routing = np.full(len(ids), np.inf)
    ref = forward(w, meta, ids, routing_margin=routing)
    comparable = routing > NEAR_ROUTING_TIE["float"]
    assert relative_errors(got, ref)[comparable].max() < FLOAT_TOL

    def without(suffix):
        return {k: v for k, v in w.items() if not k.endswith(suffix)}

    w_gate = {k: v for k, v in w.items() if not k.endswith("exps.bias")}
    variants = {
        "no sinks": (without("attn_sinks.weight"), meta, None),
        "no router bias": (without("ffn_gate_inp.bias"), meta, None),
        "no expert biases": (w_gate, meta, None),
        "plain SwiGLU": (w, meta, "silu"),
        "no window": (w, {**meta, "gpt-oss.attention.sliding_window": 10**6}, None),
        "no YaRN": (w, {k: v for k, v in meta.items() if "rope.scaling" not in k}, None),
    }
    for what, (w2, meta2, act) in variants.items():
        far = relative_errors(got, forward(w2, meta2, ids, activation=act))
        assert np.median(far) > 30 * FLOAT_TOL, f"{what}: only {np.median(far):.1e} away"


@pytest.mark.parametrize(
    "what, kwargs, message",
    [
        (
            "no window",
            dict(sliding_window=None),
            r"gpt-oss\.attention\.sliding_window is missing",
        ),
        (
            "one of the expert biases missing",
            dict(skip=("blk.1.ffn_up_exps.bias",)),
            r"blk\.1\.ffn_up_exps\.bias is missing",
        ),
        (
            "a layer without its sinks",
            dict(skip=("blk.2.attn_sinks.weight",)),
            r"blk\.2\.attn_sinks\.weight is missing",
        ),
    ],
)
def test_bad_gpt_oss_files_name_the_key_or_tensor(tmp_path, what, kwargs, message):
    path = write_moe(tmp_path / "m.gguf", "gpt-oss", Q.Q4_0, **kwargs)
    with pytest.raises(ModelError, match=message):
        _core.Model(path, 2)


@pytest.mark.parametrize("arch", ["deepseek2", "glm4moe", "dbrx"])
def test_other_moe_families_are_refused_by_name(tmp_path, arch):
    path = write_model(tmp_path / "m.gguf", arch=arch)
    with pytest.raises(
        ModelError, match=f"'{arch}' is a mixture-of-experts architecture .*qwen3moe"
    ):
        _core.Model(path, 2)


def test_neuron_sparsity_and_profiling_are_refused_on_experts(tmp_path):
    path = write_moe(tmp_path / "m.gguf", "mixtral", Q.Q4_0)
    s = _core.Session(_core.Model(path, 2), 32, "f32")
    with pytest.raises(ValueError, match="not supported on mixture-of-experts models"):
        s.set_sparsity("threshold", gate_cutoffs=[0.1, 0.1])
    with pytest.raises(ValueError, match="capturing FFN activations: not supported on mixture"):
        s.set_capture(True)
    with pytest.raises(ValueError, match="calibration: not supported on mixture-of-experts"):
        s.calibrate(list(range(20)), 8, [0.5])
    # the session still runs densely
    assert s.eval([1, 2, 3]).shape == (264,)


def test_routing_is_counted_per_session_and_profiled(tmp_path):
    """The tokens each layer routed to each expert, counted per session (batched or not) as
    the reference routes them; the profiler turns them into per-layer expert frequencies that
    GPU placement and predictor training refuse, by name, to read as neurons."""
    path = write_moe(tmp_path / "m.gguf", "olmoe", Q.F32)
    model = _core.Model(path, 2)
    cfg = model.config()
    ids = np.random.default_rng(4).integers(0, cfg["n_vocab"], size=12).tolist()
    w, meta = read_weights(path)

    # the reference's routing of the same tokens
    want = np.zeros((cfg["n_layer"], cfg["experts"]["n_expert"]), dtype=np.int64)
    routes = []
    forward(w, meta, ids, routes=routes)
    for layer, chosen in routes:
        np.add.at(want[layer], chosen.ravel(), 1)
    s = _core.Session(model, 32, "f32")
    s.eval(ids[:5])
    for t in ids[5:]:
        s.eval([t])
    got = s.take_expert_counts()
    assert got.dtype == np.uint64 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert (s.take_expert_counts() == 0).all()
    assert (
        _core.Session(_core.Model(write_model(tmp_path / "d.gguf"), 2), 8).take_expert_counts()
        is None
    )

    from powerinfer_rs.offline import load_profile, profile, train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the theory of the thing in an instant " * 40)
    engine = Engine.load(path, threads=2, n_ctx=64, device="cpu")
    p = profile(engine, str(corpus), tokens=200, window=64, plot=False, progress=False)
    loaded = load_profile(p["path"])
    assert loaded["unit"] == "expert" and loaded["counts"].shape == want.shape
    # every window's tokens each routed to n_used experts in every layer
    k = cfg["experts"]["n_expert_used"]
    assert (loaded["counts"].sum(axis=1) == k * loaded["n_tokens"]).all()
    with pytest.raises(ValueError, match="predictor training reads a profile of FFN neurons"):
        train(p["path"])


@pytest.mark.parametrize(
    "family,dtype",
    [
        ("qwen2moe", Q.F32),
        ("qwen2moe", Q.Q4_0),
        ("qwen2moe", Q.Q4_K),
        ("smallthinker", Q.F32),
        ("gpt-oss", Q.F32),
        ("gpt-oss", Q.MXFP4),
    ],
    ids=lambda v: getattr(v, "name", v),
)
@ON_DEVICES
def test_experts_on_the_gpu_at_several_splits(tmp_path, family, dtype, device):
    """Attention and KV cache on the device, the experts split by the budget (most routed first
    with a profile, by index without), by llama.cpp's --n-cpu-moe and -ngl: each as the CPU
    computes it (float weights and Q4_0: to float error; the k-quants, whose GPU kernels round
    their input per 32 where the CPU does per 256, about as close to the float64 function as
    the CPU: measured 0.78x to 1.43x the CPU's distance over seeds and splits, attention alone
    on the device included), with the GPU's share of the routed experts the split's. Qwen2-MoE
    (its shared expert), SmallThinker (its router reads the layer input, wherever the
    residual stream is; ReGLU experts) and gpt-oss (attention sinks, biased router and experts,
    the clamped SwiGLU; MXFP4 weights)."""
    path = write_moe(tmp_path / "m.gguf", family, dtype)
    cpu = Engine.load(path, device="cpu", n_ctx=64, kv_type="f32")
    ids = np.random.default_rng(5).integers(3, 260, size=24).tolist()
    want = cpu.logits(ids)
    w, meta = read_weights(path)
    exact = forward(w, meta, ids)
    cpu_err = relative_errors(want, exact).mean()
    n_layer, n_expert = cpu.config["n_layer"], cpu.config["experts"]["n_expert"]
    # an expert profile: the placement takes the most routed experts
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the theory of the thing in an instant " * 40)
    from powerinfer_rs.offline import profile
    from powerinfer_rs.placement import model_bytes

    counts = profile(cpu, str(corpus), tokens=120, window=60, plot=False, progress=False)["counts"]
    mb = model_bytes(path, 64)
    dense = int(sum(mb.layer_dense_bytes) + 2 * mb.kv_cache_bytes + mb.output_bytes)
    third = dense + int(sum(mb.expert_bytes) / 3)
    splits = [
        (dict(), n_layer * n_expert),
        (dict(vram_budget=third), None),
        (dict(vram_budget=third, profile=str(tmp_path / "m.gguf.profile.npz")), None),
        (dict(n_cpu_moe=1), (n_layer - 1) * n_expert),
        (dict(gpu_layers=1), n_expert),
        (dict(n_cpu_moe=n_layer), 0),
    ]
    for kwargs, on_gpu in splits:
        e = Engine.load(path, device=device, n_ctx=64, kv_type="f32", **kwargs)
        r = e.gpu_report()
        if on_gpu is not None:
            assert r["hot_experts"] == on_gpu, (kwargs, r)
        else:
            assert 0 < r["hot_experts"] < n_layer * n_expert, (kwargs, r)
        # prompts in passes of rows, at every split (the logits below check them against the
        # CPU's, and against the same tokens one at a time)
        assert r["prompt_rows"] == 32, (kwargs, r)
        if "profile" in kwargs:
            # the most routed experts of each layer went to the GPU
            placed = np.stack(e.placement.expert_on_gpu)
            routed_there = (counts * placed).sum() / counts.sum()
            assert routed_there >= placed.mean(), (routed_there, placed.mean())
        got = e.logits(ids)
        s = e._session()
        one = np.stack([np.atleast_2d(s.eval([t]))[-1] for t in ids])
        assert np.median(relative_errors(got, one)) < 1e-5, kwargs
        if dtype == Q.Q4_K:
            err = relative_errors(got, exact).mean()
            assert err <= 1.5 * cpu_err, (kwargs, err, cpu_err)
        else:
            # (an activation at an int8 rounding tie may round apart on the two sides: that
            # token moves by up to ~1%, the others stay at float error)
            err = relative_errors(got, want)
            assert np.median(err) < 1e-5 and err.max() < 1e-2, (kwargs, err)
        # the share of routed experts the GPU computed is the split's
        e.generate("the an in", max_tokens=4, temperature=0.0)
        share = e.last_stats.get("gpu_neuron_share")
        if on_gpu == 0:
            assert not share, (kwargs, share)
        elif on_gpu == n_layer * n_expert:
            assert share == pytest.approx(1.0), (kwargs, share)
        else:
            assert 0 < share < 1, (kwargs, share)


def test_a_bad_expert_split_is_named(tmp_path):
    path = write_moe(tmp_path / "m.gguf", "mixtral", Q.Q4_0)
    model = _core.Model(path, 2)
    n_layer, n_ff = model.config()["n_layer"], model.config()["n_ff"]
    neurons = [[False] * n_ff] * n_layer

    def gpu_model(dense, experts):
        return _core.GpuModel(
            model, dense, neurons, False, device="emulated", expert_on_gpu=experts
        )

    with pytest.raises(
        ValueError, match="layer 0 of the expert placement has 3 experts, the model 8"
    ):
        gpu_model([True, True], [[True] * 3, [True] * 8])
    with pytest.raises(ValueError, match="the expert placement has 1 layers, the model 2"):
        gpu_model([True, True], [[True] * 8])
    with pytest.raises(ValueError, match="layer 1 places experts on the GPU but not its attention"):
        gpu_model([True, False], [[True] * 8, [True] * 8])
    dense = _core.Model(write_model(tmp_path / "d.gguf"), 2)
    with pytest.raises(ValueError, match="n_cpu_moe places experts: this model is not a mixture"):
        Engine.load(str(tmp_path / "d.gguf"), device="emulated", n_cpu_moe=1)
    assert dense.config()["experts"] is None
