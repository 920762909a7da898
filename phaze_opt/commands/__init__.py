"""Subcommands of `phaze-opt`; see phaze_opt.cli for the contract each module follows."""
