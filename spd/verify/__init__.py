"""What decides a draft: the sampling and verification rules (one rule for every decoder), and the draft trees
and their cache rows."""
