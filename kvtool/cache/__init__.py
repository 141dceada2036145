"""The prefix cache: `prefix.PrefixCache` (chain, walk over the tier stack, KV assembly), its hit and stats records, and the per-model self-check."""
