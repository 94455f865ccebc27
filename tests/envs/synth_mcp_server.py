"""An MCP server whose tool list `steprl synth` reads as documentation (tests/envs/test_synth.py):
a clinic's patients and appointments, a domain like none of the shipped specs.

    python tests/envs/synth_mcp_server.py

Its tools work over a small in-memory state of their own; synthesis reads only their names,
descriptions and input schemas (the synthesized env implements them over its typed state).
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

server = MCPServer(
    "steprl-synth-clinic", instructions="A clinic's patients and appointments.", log_level="CRITICAL"
)
PATIENTS: dict[str, dict[str, object]] = {"N1": {"name": "ada", "ward": "east", "age": 40}}
VISITS: dict[str, dict[str, object]] = {}


@server.tool()
def find_patient(name: str) -> str:
    """The id of the patient with this name."""
    return next(k for k, p in PATIENTS.items() if p["name"] == name)


@server.tool()
def get_age(patient_id: str) -> int:
    """A patient's age."""
    return int(PATIENTS[patient_id]["age"])  # type: ignore[call-overload]


@server.tool()
def move_ward(patient_id: str, ward: str) -> str:
    """Move a patient to another ward."""
    PATIENTS[patient_id]["ward"] = ward
    return "ok"


@server.tool()
def book_visit(patient: str, doctor: str) -> str:
    """Book a visit of a patient with a doctor; returns the new visit's id."""
    VISITS[f"V{len(VISITS)}"] = {"patient": patient, "doctor": doctor}
    return f"V{len(VISITS) - 1}"


@server.tool()
def cancel_visit(visit_id: str) -> str:
    """Cancel a visit."""
    VISITS.pop(visit_id)
    return "ok"


@server.tool()
def server_time() -> str:
    """The server's clock (no effect on the clinic)."""
    return "12:00"


if __name__ == "__main__":
    server.run("stdio")
