"""``preheat doctor``: is this node (and this replica, origin, registry) set up to start a model fast?

    from preheat.doctor import DoctorOptions, run_doctor
    report = run_doctor(DoctorOptions(model="/models/llama", gpu_cost_per_hour=4.0))
    report.to_json()   # {"schema": "preheat.doctor/1", "status": "warn", "exit_code": 1, "findings": [...]}

Findings are ranked by the seconds they cost per cold start; docs/operations.md explains each id and its fix.
"""

from preheat.doctor.check import DoctorOptions
from preheat.doctor.findings import SCHEMA, Finding, Report
from preheat.doctor.run import run_doctor

__all__ = ["SCHEMA", "DoctorOptions", "Finding", "Report", "run_doctor"]
