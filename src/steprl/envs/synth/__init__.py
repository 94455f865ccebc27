"""Environment synthesis (`steprl synth`): from a tool-documentation YAML to a validated env
package, with no LLM: `spec` (the file), `world` (the state), `templates` (tools over it),
`plans` (graph, walks, DAG templates, tasks), `env`, `validate` (reference plan and hack
probes), `package` (generate, write, load)."""

from steprl.envs.synth.package import SynthReport, load_package, synthesize, write_package
from steprl.envs.synth.spec import SynthSpec, SynthSpecError
from steprl.envs.synth.templates import load_spec, parse_spec

__all__ = [
    "SynthReport",
    "SynthSpec",
    "SynthSpecError",
    "load_package",
    "load_spec",
    "parse_spec",
    "synthesize",
    "write_package",
]
