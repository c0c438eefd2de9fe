"""The DTYPE[:SCALES] configuration syntax shared by eval-kv and compare."""

from __future__ import annotations

import pytest

from fp8serve.calibration.kv_config import KVConfig
from fp8serve.errors import UserError


def test_parse(tmp_path):
    f = tmp_path / "s.json"
    f.write_text("{}")
    assert KVConfig.parse("fp8") == KVConfig("fp8_e4m3", "default")
    assert KVConfig.parse("fp8_e4m3:scale1").label == "fp8_e4m3:scale1"
    c = KVConfig.parse(f"fp8_e4m3:json={f}")
    assert (c.scales, c.json_path, c.label) == ("json", str(f), "fp8_e4m3:json=s.json")
    assert c.engine_kwargs() == {"kv_cache_dtype": "fp8_e4m3", "quantization_param_path": str(f),
                                 "calculate_kv_scales": False}
    assert KVConfig.parse("fp8_e4m3:calculate").engine_kwargs()["calculate_kv_scales"] is True
    assert KVConfig.parse("auto").label == "auto"
    for bad, msg in [("int8", "unknown KV cache dtype"), ("fp8:sometimes", "unknown scales"),
                     ("fp8:json=/nope.json", "not found")]:
        with pytest.raises(UserError, match=msg):
            KVConfig.parse(bad)


def test_parse_refuses_configurations_that_would_mean_nothing(tmp_path):
    """Scales on a 16/32-bit cache were accepted and ignored (a second, identical row under another
    label); an empty SCALES and a directory as json= were unclear."""
    for bad, msg in [("auto:calculate", "scales apply to an FP8 KV cache only"),
                     ("bfloat16:scale1", "use fp8_e4m3:scale1 or fp8_e5m2:scale1, or 'bfloat16' alone"),
                     (f"float32:json={tmp_path}", "scales apply to an FP8 KV cache only"),
                     ("fp8_e4m3:", "nothing after ':'"),
                     ("fp8_e4m3:json=", "json= needs a file"),
                     (f"fp8_e5m2:json={tmp_path}", "is a directory; expected a JSON file")]:
        with pytest.raises(UserError, match=msg):
            KVConfig.parse(bad)


def test_for_dtypes(tmp_path):
    f = tmp_path / "s.json"
    f.write_text("{}")
    assert [c.label for c in KVConfig.for_dtypes(["auto", "fp8"])] == ["auto", "fp8_e4m3"]
    assert [c.label for c in KVConfig.for_dtypes(["fp8_e5m2"], calculate=True)] == ["fp8_e5m2:calculate"]
    assert [c.json_path for c in KVConfig.for_dtypes(["fp8", "fp8_e5m2"], str(f))] == [str(f)] * 2
    with pytest.raises(UserError, match="--calculate-kv-scales applies to FP8 KV caches only, .* includes "
                                        "bfloat16, auto"):
        KVConfig.for_dtypes(["bfloat16", "fp8", "auto"], calculate=True)
