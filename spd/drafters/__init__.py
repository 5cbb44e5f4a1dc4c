"""Drafters behind one small interface (`spd.drafters.base.Drafter`): one file each."""
