"""What decides a draft: the sampling and verification rules (one rule for every decoder: `accept` for a cycle's
deterministic drafts as tensor functions, `sampling` for drafts with a q and node by node, `device_sampling` for the
same rule as device tensors inside a device step), and the draft trees and their cache rows."""
