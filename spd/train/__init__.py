"""Distillation trainer for the speculation module (kept apart from decoding; imports the same layout/module code)."""
