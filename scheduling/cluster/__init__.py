"""N replicas behind a router: each replica an unchanged V1 engine (its own KV pool and policy), one
clock for all, and a router that sees only what a real router sees (its own traffic, the replicas'
load as last scraped, the prefixes it sent where). See docs/cluster.md."""
