"""The real model sizes: creation on 64 simulated devices (in a fresh process)."""

from subproc import run_probe


def test_qwen3_next_layer_is_created_sharded_on_64_devices():
    """nnx.eval_shape gives abstract parameters carrying their at-rest shardings, and
    the compiled init program's per-device memory (outputs + temporaries) is a small
    multiple of the shard, nowhere near the full tensors (6.4 GB in float32)."""
    probe = run_probe("init_at_scale", 64)
    params = probe["params"]
    for name, p in params.items():
        assert p["abstract_type"] == "ShapeDtypeStruct", name
        assert p["abstract_spec"] == p["layout_spec"], name
    shards = sum(p["shard_bytes"] for p in params.values())
    full = sum(p["full_bytes"] for p in params.values())
    assert params["wi_0_EMH"]["full_bytes"] == 512 * 2048 * 512 * 4
    assert params["wi_0_EMH"]["shard_bytes"] * 64 == params["wi_0_EMH"]["full_bytes"]
    # Each device creates exactly its shards (XLA pads small buffers to its alignment).
    assert 0 <= probe["output_bytes"] - shards <= 64 * len(params)
    assert probe["output_bytes"] + probe["temp_bytes"] <= 4 * shards
    assert probe["output_bytes"] + probe["temp_bytes"] <= full / 16
