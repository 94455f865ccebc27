"""The fault-injection battery's probes, one module per surface (run by benchmarks/fault_battery.py)."""
