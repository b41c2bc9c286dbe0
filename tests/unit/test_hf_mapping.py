"""Tests of the Megatron <-> Hugging Face Qwen2 mapping (dapo_megatron.models.hf_mapping)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.hf_mapping import (
    canonical_megatron_name,
    gather_tensor_parallel,
    global_to_local_name,
    hf_param_names,
    hf_param_shapes,
    hf_to_megatron,
    layer_range,
    local_to_global_name,
    megatron_param_names,
    megatron_param_shapes,
    megatron_state_to_hf,
    megatron_to_hf,
    shard_for_tensor_parallel,
    stack_for_torch_dist,
    tensor_parallel_dim,
    unstack_torch_dist,
)
from tests.model_configs import small_model_config

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
QKV_BIAS = "decoder.layers.0.self_attention.linear_qkv.bias"
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
EMBEDDING = "embedding.word_embeddings.weight"

HfModel = tuple[ModelConfig, torch.nn.Module]


def tiny_config(*, tied: bool = False, heads: int = 4, groups: int = 2, **overrides: object) -> ModelConfig:
    """Vocab 250, so that Megatron pads it."""
    fields: dict[str, object] = dict(
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=250,
        params_dtype="float32",
        tie_word_embeddings=tied,
    )
    return small_model_config(**(fields | overrides))


def random_hf_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in hf_param_shapes(cfg).items()}


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_model(request: pytest.FixtureRequest) -> HfModel:
    """A tiny random transformers Qwen2ForCausalLM and its config."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config(tied=request.param)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg.to_hf_config())).eval()
    # HF starts biases at zero and norms at one; random values make any misplaced tensor visible.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.1)
    return cfg, model


# ---------------------------------------------------------------- HF <-> Megatron


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_megatron_hf_round_trip_is_bit_exact(hf_model: HfModel, tp: int) -> None:
    cfg, model = hf_model
    hf_state = model.state_dict()
    assert "lm_head.weight" in hf_state  # transformers includes it even when tied; it must be accepted

    megatron = hf_to_megatron(hf_state, cfg, tensor_parallel_size=tp)

    assert list(megatron) == megatron_param_names(cfg)
    assert {name: tuple(t.shape) for name, t in megatron.items()} == megatron_param_shapes(cfg, tp)
    padded_vocab = cfg.padded_vocab_size(tp)
    assert padded_vocab > cfg.vocab_size and padded_vocab % tp == 0
    assert megatron[EMBEDDING].shape == (padded_vocab, 64)
    assert not megatron[EMBEDDING][cfg.vocab_size :].any()
    assert ("output_layer.weight" in megatron) is not cfg.tie_word_embeddings
    assert torch.equal(
        megatron[FC1],
        torch.cat(
            [hf_state["model.layers.0.mlp.gate_proj.weight"], hf_state["model.layers.0.mlp.up_proj.weight"]]
        ),
    )

    back = megatron_state_to_hf(megatron, cfg)
    expected = {
        name: t for name, t in hf_state.items() if not (cfg.tie_word_embeddings and name == "lm_head.weight")
    }
    assert sorted(back) == sorted(expected) == sorted(hf_param_names(cfg))
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize(
    ("heads", "groups", "row_blocks"),
    [
        # Megatron rows: per query group, its query heads, then its key head, then its value head
        # (d = 2 rows each).
        (4, 2, [("q", 0, 4), ("k", 0, 2), ("v", 0, 2), ("q", 4, 8), ("k", 2, 4), ("v", 2, 4)]),
        (4, 1, [("q", 0, 8), ("k", 0, 2), ("v", 0, 2)]),
        (2, 2, [("q", 0, 2), ("k", 0, 2), ("v", 0, 2), ("q", 2, 4), ("k", 2, 4), ("v", 2, 4)]),
    ],
)
def test_qkv_interleave_matches_hand_built_layout(
    heads: int, groups: int, row_blocks: list[tuple[str, int, int]]
) -> None:
    cfg = small_model_config(
        num_layers=1,
        hidden_size=3,
        kv_channels=2,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=4,
        vocab_size=8,
    )
    hf_state = random_hf_state(cfg)
    proj = {}
    for offset, x in zip((0, 1000, 2000), "qkv", strict=True):
        rows = hf_state[f"model.layers.0.self_attn.{x}_proj.weight"].shape[0]
        proj[x] = offset + torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
        hf_state[f"model.layers.0.self_attn.{x}_proj.weight"] = proj[x]
        hf_state[f"model.layers.0.self_attn.{x}_proj.bias"] = proj[x][:, 0]
    expected = torch.cat([proj[x][start:stop] for x, start, stop in row_blocks])

    megatron = hf_to_megatron(hf_state, cfg)

    assert torch.equal(megatron[QKV], expected)
    assert torch.equal(megatron[QKV_BIAS], expected[:, 0])
    for name in (QKV, QKV_BIAS):
        for hf_name, tensor in megatron_to_hf(name, megatron[name], cfg):
            assert torch.equal(tensor, hf_state[hf_name]), hf_name
    # Each TP rank holds whole query groups, so a plain row split gives rank r the block of group r.
    group_rows = expected.shape[0] // groups
    for rank in range(groups):
        shard = shard_for_tensor_parallel(QKV, megatron[QKV], cfg, groups, rank)
        assert torch.equal(shard, expected[rank * group_rows : (rank + 1) * group_rows])


@pytest.mark.parametrize("tp", [2, 4])
def test_fc1_shards_hold_gate_and_up_rows_of_their_rank(tp: int) -> None:
    cfg = tiny_config(heads=8, groups=4)
    f, h = cfg.ffn_hidden_size, cfg.hidden_size
    gate = torch.arange(f * h, dtype=torch.float32).view(f, h)
    up = -1 - gate
    full = torch.cat([gate, up])
    rows = f // tp

    shards = [shard_for_tensor_parallel(FC1, full, cfg, tp, rank) for rank in range(tp)]

    for rank, shard in enumerate(shards):
        part = slice(rank * rows, (rank + 1) * rows)
        assert torch.equal(shard, torch.cat([gate[part], up[part]])), rank
    assert torch.equal(gather_tensor_parallel(FC1, shards), full)
    assert not torch.equal(torch.cat(shards), full)  # why fc1 needs its own gather


@pytest.mark.parametrize(("heads", "groups", "tp"), [(4, 2, 1), (4, 2, 2), (8, 4, 4)])
def test_every_parameter_shards_and_gathers_back(heads: int, groups: int, tp: int) -> None:
    cfg = tiny_config(heads=heads, groups=groups)
    megatron = hf_to_megatron(random_hf_state(cfg), cfg, tensor_parallel_size=tp)
    for name, full in megatron.items():
        shards = [shard_for_tensor_parallel(name, full, cfg, tp, rank) for rank in range(tp)]
        dim = tensor_parallel_dim(name)
        shard_shape = list(full.shape)
        if dim is not None:
            shard_shape[dim] //= tp
        assert all(list(shard.shape) == shard_shape for shard in shards), name
        assert torch.equal(gather_tensor_parallel(name, shards), full), name


def test_tensor_parallel_dims_follow_megatron_core() -> None:
    expected = {
        EMBEDDING: 0,
        "output_layer.weight": 0,
        "decoder.final_layernorm.weight": None,
        "decoder.layers.3.input_layernorm.weight": None,
        "decoder.layers.3.pre_mlp_layernorm.weight": None,
        "decoder.layers.3.self_attention.linear_qkv.weight": 0,
        "decoder.layers.3.self_attention.linear_qkv.bias": 0,
        "decoder.layers.3.mlp.linear_fc1.weight": 0,
        "decoder.layers.3.self_attention.linear_proj.weight": 1,
        "decoder.layers.3.mlp.linear_fc2.weight": 1,
        "module.module.decoder.layers.3.mlp.linear_fc1.layer_norm_weight": None,
    }
    assert {name: tensor_parallel_dim(name) for name in expected} == expected


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    groups_per_rank=st.integers(1, 2),
    heads_per_group=st.integers(1, 3),
    head_dim=st.integers(1, 3),
    tied=st.booleans(),
)
def test_mapping_inverts_for_any_grouped_attention_shape(
    tp: int, groups_per_rank: int, heads_per_group: int, head_dim: int, tied: bool
) -> None:
    groups = tp * groups_per_rank
    cfg = small_model_config(
        num_layers=1,
        hidden_size=4,
        kv_channels=head_dim,
        num_attention_heads=groups * heads_per_group,
        num_query_groups=groups,
        ffn_hidden_size=4 * tp,
        vocab_size=5,
        tie_word_embeddings=tied,
    )
    hf_state = random_hf_state(cfg)
    megatron = hf_to_megatron(hf_state, cfg, tensor_parallel_size=tp)
    gathered = {
        name: gather_tensor_parallel(
            name, [shard_for_tensor_parallel(name, full, cfg, tp, rank) for rank in range(tp)]
        )
        for name, full in megatron.items()
    }
    back = megatron_state_to_hf(gathered, cfg)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[name], hf_state[name]) for name in hf_state)


def test_megatron_to_hf_returns_views_where_documented() -> None:
    cfg = tiny_config()
    megatron = hf_to_megatron(random_hf_state(cfg), cfg)
    for name in (FC1, EMBEDDING, "decoder.layers.0.self_attention.linear_proj.weight"):
        for hf_name, tensor in megatron_to_hf(name, megatron[name], cfg):
            assert tensor.untyped_storage().data_ptr() == megatron[name].untyped_storage().data_ptr(), hf_name


def test_megatron_names_are_canonicalised() -> None:
    cfg = tiny_config(tied=True)
    norm = torch.randn(64)
    te_name = "module.module.decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert canonical_megatron_name(te_name) == "decoder.layers.1.input_layernorm.weight"
    assert megatron_to_hf(te_name, norm, cfg) == [("model.layers.1.input_layernorm.weight", norm)]
    assert megatron_to_hf("module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight", norm, cfg) == [
        ("model.layers.0.post_attention_layernorm.weight", norm)
    ]
    assert megatron_to_hf("decoder.layers.0.mlp.linear_fc1._extra_state", None, cfg) == []
    # Tied: the last pipeline stage's copy of the embedding is not sent; embed_tokens alone carries it.
    assert megatron_to_hf("output_layer.weight", torch.zeros(256, 64), cfg) == []
    embedding = megatron_to_hf(EMBEDDING, torch.zeros(256, 64), cfg)
    assert [name for name, _ in embedding] == ["model.embed_tokens.weight"]


# ---------------------------------------------------------------- pipeline parallelism and torch_dist


def test_pipeline_stages_split_layers_evenly_and_names_translate() -> None:
    cfg = tiny_config(num_layers=6)
    assert [layer_range(cfg, 3, rank) for rank in range(3)] == [range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(ValueError, match=r"num_layers \(6\) is not divisible by the pipeline-parallel size"):
        layer_range(cfg, 4, 0)

    local = "module.decoder.layers.1.mlp.linear_fc1.weight"
    assert local_to_global_name(local, 4) == "module.decoder.layers.5.mlp.linear_fc1.weight"
    assert global_to_local_name("module.decoder.layers.5.mlp.linear_fc1.weight", 4) == local
    assert local_to_global_name("decoder.final_layernorm.weight", 4) == "decoder.final_layernorm.weight"
    with pytest.raises(ValueError, match="before this stage's first layer"):
        global_to_local_name("decoder.layers.1.mlp.linear_fc1.weight", 4)


def test_torch_dist_layout_stacks_layers_under_te_names() -> None:
    cfg = tiny_config()
    megatron = hf_to_megatron(random_hf_state(cfg), cfg)
    stacked_shapes = {
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 64),
        "decoder.layers.self_attention.linear_qkv.weight": (2, 128, 64),
        "decoder.layers.self_attention.linear_qkv.bias": (2, 128),
        "decoder.layers.self_attention.linear_proj.weight": (2, 64, 64),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 64),
        "decoder.layers.mlp.linear_fc1.weight": (2, 256, 64),
        "decoder.layers.mlp.linear_fc2.weight": (2, 64, 128),
        EMBEDDING: (256, 64),
        "decoder.final_layernorm.weight": (64,),
        "output_layer.weight": (256, 64),
    }

    flat = stack_for_torch_dist(megatron, cfg)

    assert {name: tuple(t.shape) for name, t in flat.items()} == stacked_shapes
    assert torch.equal(
        flat["decoder.layers.mlp.linear_fc1.weight"][1], megatron["decoder.layers.1.mlp.linear_fc1.weight"]
    )
    not_model = {
        "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight": torch.zeros(2, 256, 64),
        "rng_state": torch.zeros(3),
        "decoder.layers.self_attention.linear_qkv._extra_state": torch.zeros(1),
    }
    unstacked = unstack_torch_dist(flat | not_model, cfg)
    assert unstacked.keys() == megatron.keys()
    assert all(torch.equal(unstacked[name], megatron[name]) for name in megatron)


def test_qwen25_32b_maps_completely_on_meta_device() -> None:
    transformers = pytest.importorskip("transformers")
    config_json = {  # Qwen/Qwen2.5-32B config.json (architecture fields)
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_attention_heads": 40,
        "num_hidden_layers": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
    }
    cfg = ModelConfig.from_hf_config(config_json, name="qwen2.5-32b")
    with torch.device("meta"):
        hf_state = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config_json)).state_dict()

    megatron = hf_to_megatron(hf_state, cfg, tensor_parallel_size=8)

    assert len(megatron) == 1 + 64 * 7 + 2
    padded_vocab = cfg.padded_vocab_size(8)
    assert padded_vocab >= 152064 and padded_vocab % 8 == 0
    assert megatron[EMBEDDING].shape == megatron["output_layer.weight"].shape == (padded_vocab, 5120)
    assert megatron["decoder.layers.63.self_attention.linear_qkv.weight"].shape == ((40 + 2 * 8) * 128, 5120)
    assert megatron["decoder.layers.63.mlp.linear_fc1.weight"].shape == (2 * 27648, 5120)
    tp8_shapes = {
        name: tuple(shard_for_tensor_parallel(name, megatron[name], cfg, 8, 7).shape)
        for name in (EMBEDDING, QKV, QKV_BIAS, FC1, "decoder.layers.0.mlp.linear_fc2.weight")
    }
    assert tp8_shapes == {
        EMBEDDING: (padded_vocab // 8, 5120),
        QKV: (896, 5120),
        QKV_BIAS: (896,),
        FC1: (6912, 5120),
        "decoder.layers.0.mlp.linear_fc2.weight": (5120, 3456),
    }

    produced = [pair for name, full in megatron.items() for pair in megatron_to_hf(name, full, cfg)]
    assert sorted(hf_name for hf_name, _ in produced) == sorted(hf_state)  # every HF tensor exactly once
    assert all(tensor.shape == hf_state[hf_name].shape for hf_name, tensor in produced)
    assert sum(tensor.numel() for _, tensor in produced) == cfg.num_parameters() == 32_763_876_352


# ---------------------------------------------------------------- errors


def test_hf_state_errors_name_every_bad_tensor() -> None:
    cfg = tiny_config()
    state = random_hf_state(cfg)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError) as error:
        hf_to_megatron(state, cfg)
    message = str(error.value)
    assert "missing (1):\n  model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected (1):\n  model.layers.0.self_attn.rotary_emb.inv_freq" in message
    assert "model.layers.0.self_attn.k_proj.weight: expected (32, 64), got (64, 64)" in message
    assert "ModelConfig.from_hf_config" in message


def test_tied_config_rejects_a_different_lm_head() -> None:
    cfg = tiny_config(tied=True)
    state = random_hf_state(cfg) | {"lm_head.weight": torch.zeros(250, 64)}
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        hf_to_megatron(state, cfg)


def test_query_groups_not_divisible_by_tp_is_refused() -> None:
    cfg = tiny_config()  # 2 query groups
    megatron = hf_to_megatron(random_hf_state(cfg), cfg, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=rf"cannot shard '{QKV}'.*num_query_groups \(2\).*divides"):
        shard_for_tensor_parallel(QKV, megatron[QKV], cfg, 4, 0)


def test_vocab_padded_for_another_tp_size_is_refused() -> None:
    cfg = tiny_config(vocab_size=75, make_vocab_size_divisible_by=25)  # padded to 75 rows at TP 1
    embedding = hf_to_megatron(random_hf_state(cfg), cfg)[EMBEDDING]
    with pytest.raises(ValueError, match=r"padded_vocab_size\(tp_size\)"):
        shard_for_tensor_parallel(EMBEDDING, embedding, cfg, 2, 0)


def test_incomplete_or_sharded_megatron_state_is_refused() -> None:
    cfg = tiny_config()
    megatron = hf_to_megatron(random_hf_state(cfg), cfg)
    stage = {global_to_local_name(name, 1): t for name, t in megatron.items() if ".layers.1." in name}
    with pytest.raises(ValueError, match=r"(?s)global layer indices.*missing \(10\):\n  embedding\."):
        megatron_state_to_hf(stage, cfg)
    with pytest.raises(ValueError, match=r"expected \(128, 64\); pass the full \(TP-gathered\)"):
        megatron_to_hf(QKV, megatron[QKV][:64], cfg)
    with pytest.raises(ValueError, match="layer 2 does not exist in a 2-layer model"):
        megatron_to_hf("decoder.layers.2.mlp.linear_fc2.weight", torch.zeros(64, 128), cfg)


# ---------------------------------------------------------------- megatron-core numerics


@pytest.fixture(scope="module")
def megatron_cpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """megatron-core in this process: a one-rank gloo group and model-parallel state, torn down afterwards.

    `cpu_compat.apply()` is process-wide and stays applied (it is a no-op with CUDA).
    """
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state, tensor_parallel

    from dapo_megatron.backends import cpu_compat
    from dapo_megatron.distributed import layout

    cpu_compat.apply()
    # A file store, not a TCP port: other test processes may share this machine.
    store = tmp_path_factory.mktemp("gloo") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # attention enters the RNG tracker
        yield
    finally:
        layout.shutdown()


def build_gpt_model(cfg: ModelConfig) -> torch.nn.Module:
    """A megatron-core local-spec GPTModel with this config's Qwen2 architecture, fp32, TP = PP = 1."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=cfg.padded_vocab_size(1),
        max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
    ).eval()


@pytest.mark.slow
def test_megatron_core_logits_match_hf(megatron_cpu: None, hf_model: HfModel) -> None:
    cfg, hf = hf_model
    model = build_gpt_model(cfg)
    assert sorted(name for name, _ in model.named_parameters()) == sorted(megatron_param_names(cfg))

    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), cfg), strict=False)
    assert unexpected == [] and all(name.endswith("._extra_state") for name in missing), (missing, unexpected)

    batch, seq = 2, 12
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).expand(batch, -1)
    # True = masked. Explicit because megatron-core builds its default causal mask on cuda.
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        expected = hf(tokens).logits
        logits = model(tokens, positions, attention_mask=causal)
    assert logits.shape == (batch, seq, cfg.padded_vocab_size(1))
    torch.testing.assert_close(logits[..., : cfg.vocab_size], expected, rtol=0, atol=1e-5)
    assert not logits[..., cfg.vocab_size :].any()  # zero padding rows give zero logits

    # The live state dict (with _extra_state entries) maps back to exactly the HF tensors.
    back = megatron_state_to_hf(model.state_dict(), cfg)
    assert all(torch.equal(back[name], hf.state_dict()[name]) for name in hf_param_names(cfg))
