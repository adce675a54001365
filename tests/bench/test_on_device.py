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
        assert r["fastest"] in names
        for key in ("published", "measured"):  # each pricing's pick is timed, with its regret
            assert r["picks"][key] in names and r["regret"][key] >= 1
        for c in r["candidates"].values():
            assert c["median_s"] > 0 and c["mfu"] > 0
            for key in ("published", "measured"):
                parts = c[f"estimated_parts_s_{key}"]  # Python 3.12's sum() compensates
                assert sum(parts.values()) == pytest.approx(c[f"estimated_s_{key}"], rel=1e-12)
    # The seed's comparison: the grouped matmul beside a dense MLP of its active FLOPs.
    assert "mlp (same active FLOPs)" in layers[0]["candidates"]
    gmm = payload["gmm"]["median_s"]
    assert {"tiled_gmm", "ragged_dot", "dense (same rows, one expert)"} <= set(gmm)
    assert "tokamax.ragged_dot" in gmm or "tokamax.ragged_dot" in payload["gmm"]["skipped"]
    constants = payload["constants"]
    for name in ("matmul_tflops", "hbm_bandwidth_gbps", "gather_gbps", "call_us", "launch_us"):
        assert constants["measured"][name] > 0, name
    # [MFLOPs, TFLOP/s], and the K x N of the matrix where the dot names one (not the
    # batched einsum's).
    for name, size in (("matmul_curve", 3), ("gmm_curve", 3), ("einsum_curve", 2)):
        points = constants["measured"][name]
        assert points and all(len(p) == size and p[1] > 0 for p in points), name
    assert set(constants["measured_over_published"]) == {"matmul_tflops", "hbm_bandwidth_gbps"}
    assert payload["failed_layers"] == {} and payload["skipped_for_time"] == []
    summary = payload["summary"]
    assert summary["layers_timed"] == 6
    assert summary["measured"]["worst_regret"] >= 1 and summary["published"]["worst_regret"] >= 1


def test_the_chips_stored_run_is_rescored_with_todays_count():
    """The H200's stored run (bench/results/on_device_h200.json, timed on the chip)
    priced again by today's count: the stored rescoring is today's (a change of the count
    or of the h200 preset that moves a pick or an estimate fails here until
    `python -m bench.on_device --rescore` is run again), and each regret is the chip's
    median of the pick over the fastest timed candidate's."""
    from bench.common import RESULTS

    run = json.loads((RESULTS / "on_device_h200.json").read_text())
    stored = json.loads((RESULTS / "on_device_h200_rescored.json").read_text())
    today = on_device.rescore(run)
    assert [r["pick"] for r in today["layers"]] == [r["pick"] for r in stored["layers"]]
    assert today["summary"] == stored["summary"]
    for now, then in zip(today["layers"], stored["layers"], strict=True):
        assert now["estimated_s"] == pytest.approx(then["estimated_s"], rel=1e-9)
        timed = now["measured_s"]
        assert now["fastest"] == min(timed, key=timed.get)
        if now["pick"] in timed:
            assert now["regret"] == timed[now["pick"]] / timed[now["fastest"]]
        else:
            assert now["regret"] is None
