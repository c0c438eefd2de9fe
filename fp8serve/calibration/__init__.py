"""Calibration for FP8: observe activation ranges over sample text, turn them
into scales, and write them where the engine reads them (a vLLM-schema JSON or
checkpoint tensors). Used by the `calibrate`, `quantize` and `eval-kv` tools;
everything here works through the engine's public objects, never inside it."""
