"""The drafters' trained models: SPD's speculation module (its attention, its initialisation), EAGLE-3's draft
model, the draft head they share, and module checkpoints (saved, shipped, loaded)."""
