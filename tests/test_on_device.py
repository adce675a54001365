"""The on-device script (`python -m bench.on_device`) in its dry mode: the same code a
chip runs, on the 8 simulated CPU devices at sizes scaled down, so it is known to work
before a chip is lent."""

import json

import pytest

from bench import on_device


def test_dry_run_times_every_candidate_and_writes_each_picks_regret(jax_cpu8, tmp_path):
    out = tmp_path / "dry.json"
    assert on_device.main(["--dry", "--rounds", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["dry"] and payload["devices"] == 8 and payload["hardware"] == "cpu"
    layers = payload["layers"]
    assert [r["layer"]["name"] for r in layers] == [layer.name for layer in on_device.LAYERS]
    for r in layers:
        assert not r["failed"], r["failed"]
        names = set(r["candidates"])
        assert {"megablox/gather", "megablox/all_to_all[context]"} <= names
        assert r["pick"] in names and r["fastest"] in names and r["regret"] >= 1
        for c in r["candidates"].values():
            assert c["median_s"] > 0 and c["mfu"] > 0
            parts = c["estimated_parts_s"]  # Python 3.12's sum() compensates: not bit-equal
            assert sum(parts.values()) == pytest.approx(c["estimated_s"], rel=1e-12)
    # The seed's comparison: the grouped matmul beside a dense MLP of its active FLOPs.
    assert "mlp (same active FLOPs)" in layers[0]["candidates"]
    gmm = payload["gmm"]["median_s"]
    assert {"tiled_gmm", "ragged_dot", "dense (same rows, one expert)"} <= set(gmm)
    assert "tokamax.ragged_dot" in gmm or "tokamax.ragged_dot" in payload["gmm"]["skipped"]
    summary = payload["summary"]
    assert summary["layers_timed"] == 6 and summary["worst_regret"] >= 1
