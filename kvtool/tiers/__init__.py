"""The tiers of a prefix cache behind one interface (`base.BlockTier`): RAM, the writer's pending buffer, SSD, remote, and the stack that walks them."""
