"""Length-aware scheduling core: requests, KV block accounting, policies, admission.

Standard library only, so the simulator and the tests run without torch.
"""
