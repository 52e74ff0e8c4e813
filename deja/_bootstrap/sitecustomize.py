"""Started by Python itself in a process that ``deja record`` or ``deja replay`` launched.

``deja`` puts this directory first on PYTHONPATH; Python imports ``sitecustomize`` at
start-up, which begins the session before the agent's first line runs.
"""

from deja.boot import start_from_env

start_from_env()
