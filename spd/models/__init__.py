"""The drafters' trained models: SPD's speculation module (its attention, its initialisation), EAGLE-3's draft
model, the draft head they share, module checkpoints (saved, shipped, loaded) and EAGLE-3 heads in other engines'
layouts (formats/)."""
