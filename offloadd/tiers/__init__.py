"""Tiers below the arena: a local disk tier and a cluster tier on Mooncake Store.

``base`` is the interface both implement; ``offloadd.tiers.disk`` and
``offloadd.tiers.mooncake`` are the tiers.
"""
