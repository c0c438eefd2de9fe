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
