"""Capacity and cost planning, and diagnosis: catalog, memory/roofline/cost model, doctor."""
