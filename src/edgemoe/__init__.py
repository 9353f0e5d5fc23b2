"""edgemoe: Mixture-of-Experts inference across heterogeneous edge servers.

The pipeline is model -> profile -> plan -> run -> results -> report; see the README.
"""

__version__ = "0.1.0"
