"""Heads in other tools' layouts: EAGLE-3 heads as SGLang, vLLM and `speculators` load them (spd.models.formats.eagle3),
and the draft layer those engines build (spd.models.formats.layer)."""
