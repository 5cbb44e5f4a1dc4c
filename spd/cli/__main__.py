from spd.cli import entry

entry()
