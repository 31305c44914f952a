"""What a vLLM replica installs for a refit version (``preheat.integrations.vllm.follow_plan``): a changed tensor
travels with the unchanged tensors vLLM fuses it with, and nothing else does."""

from __future__ import annotations

import pytest

from preheat.core.errors import RefitError
from preheat.integrations.vllm.follow_plan import Staged, install_set, layout, unit_of

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
LAYER = [
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.norm.weight",
]


def test_a_changed_k_proj_is_installed_with_its_layers_q_and_v_and_their_biases() -> None:
    got = install_set(["model.layers.0.self_attn.k_proj.weight"], LAYER, LLAMA_PACKED)
    assert got == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ]


def test_an_unfused_tensor_travels_alone_and_another_layers_tensors_never_join() -> None:
    assert install_set(["model.layers.0.mlp.down_proj.weight"], LAYER, LLAMA_PACKED) == [
        "model.layers.0.mlp.down_proj.weight"
    ]
    assert install_set(["model.norm.weight"], LAYER, LLAMA_PACKED) == ["model.norm.weight"]
    assert "model.layers.1.self_attn.k_proj.weight" not in install_set(
        ["model.layers.0.self_attn.q_proj.weight"], LAYER, LLAMA_PACKED
    )


def test_gate_and_up_go_together_and_units_stay_grouped_in_the_versions_order() -> None:
    got = install_set(["model.layers.0.mlp.up_proj.weight", "model.norm.weight"], LAYER, LLAMA_PACKED)
    assert got == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


def test_without_a_packing_every_tensor_is_its_own_unit() -> None:
    assert install_set(["model.layers.0.self_attn.k_proj.weight"], LAYER, {}) == [
        "model.layers.0.self_attn.k_proj.weight"
    ]
    assert unit_of("lm_head.weight", LLAMA_PACKED) == "lm_head"
    assert unit_of("q_proj.weight", LLAMA_PACKED) == "qkv_proj"


def test_staged_tensors_are_aligned_and_survive_the_rpc_wire() -> None:
    staged = layout([("a", "F32", (3,), 12, "xxh3-128:" + 32 * "0"), ("b", "BF16", (2, 2), 8, "xxh3-128:" + 32 * "1")])
    assert [s.offset for s in staged] == [0, 64]
    assert [Staged.from_wire(s.to_wire()) for s in staged] == staged


@pytest.mark.parametrize(
    "wire",
    [
        ["a", "F32", [3], 0, 12],
        ["a", "F32", "3", 0, 12, "d"],
        ["a", "F32", [3], -1, 12, "d"],
        [1, "F32", [3], 0, 12, "d"],
    ],
)
def test_a_malformed_staged_entry_is_refused(wire: list[object]) -> None:
    with pytest.raises(RefitError):
        Staged.from_wire(wire)
