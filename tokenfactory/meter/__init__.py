"""The meter: power sources, attribution of step energy to requests, prices, the ledger."""
