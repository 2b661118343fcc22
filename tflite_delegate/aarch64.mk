# libpkm_tflite.so cross-built for aarch64 Linux, and its tests in aarch64
# TFLite interpreters under qemu-user emulation. Included by Makefile.
#   make tflite-aarch64   cross-build build/aarch64/libpkm_tflite.so
#   make test-aarch64     arm64 Debian root + aarch64 wheels (cached under .cache/), then the
#                         core's C++ test and tests/aarch64 in them under qemu-aarch64
# Same sources and flags as tflite.mk (its TFLITE_SRCS / TFLITE_CXXFLAGS, the
# core's CORE_SRCS / CORE_CXXFLAGS); only the compiler differs.
A64_CXX      := aarch64-linux-gnu-g++
A64_OBJDUMP  := aarch64-linux-gnu-objdump
A64_QEMU     := qemu-aarch64-static
A64_BUILD    := $(BUILDDIR)/aarch64
A64_LIB      := $(A64_BUILD)/libpkm_tflite.so
A64_OBJS     := $(patsubst %.cc,$(A64_BUILD)/%.o,$(CORE_SRCS) $(TFLITE_SRCS))
A64_CACHE    := .cache/aarch64
A64_ROOT     := $(A64_CACHE)/root
A64_SUITE    := bookworm
A64_MIRROR   ?= http://deb.debian.org/debian
# Debian packages the targets need; installed with apt-get when a tool is missing.
A64_DEBS     := g++-aarch64-linux-gnu binutils-aarch64-linux-gnu qemu-user-static debootstrap file
A64_ROOT_STAMP  := $(A64_ROOT)/.unpacked
# One site-packages per interpreter (they pin different numpy majors).
A64_RUNTIMES := tflite_runtime litert
A64_PLATFORMS := --platform manylinux_2_34_aarch64 --platform manylinux_2_27_aarch64 \
                 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64
A64_PIP_TARGET := --only-binary=:all: --python-version 3.11 --implementation cp $(A64_PLATFORMS)

# Order-only prerequisite: checked on every run, never forces a rebuild.
aarch64-tools:
	@missing=; for t in $(A64_CXX) $(A64_OBJDUMP) $(A64_QEMU) debootstrap file; do \
	  command -v $$t >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $(A64_DEBS)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(A64_DEBS); \
	fi

$(A64_BUILD)/$(CORE_DIR)/%.o: $(CORE_DIR)/%.cc $(CORE_HDRS) | aarch64-tools
	@mkdir -p $(dir $@)
	$(A64_CXX) $(CORE_CXXFLAGS) -c $< -o $@

$(A64_BUILD)/$(TFLITE_DIR)/%.o: $(TFLITE_DIR)/%.cc $(TFLITE_HDRS) $(CORE_HDRS) | aarch64-tools
	@mkdir -p $(dir $@)
	$(A64_CXX) $(TFLITE_CXXFLAGS) -c $< -o $@

$(A64_LIB): $(A64_OBJS)
	$(A64_CXX) -shared $^ -o $@ -Wl,--no-undefined -Wl,-z,defs -lpthread

# The core's own C++ test (fast kernels vs reference, half conversions), for aarch64.
A64_CORE_OBJS := $(patsubst %.cc,$(A64_BUILD)/%.o,$(CORE_SRCS) $(PKM_CORE_REFERENCE_SRCS))
A64_CORE_TEST := $(A64_BUILD)/core_test
$(A64_CORE_TEST): $(PKM_CORE_TEST_SRCS) $(A64_CORE_OBJS) $(CORE_HDRS)
	$(A64_CXX) $(CXXSTD) -O2 -I. $< $(A64_CORE_OBJS) -o $@ -lpthread

tflite-aarch64: $(A64_LIB)
	file -L $(A64_LIB)

# Hot loops as the compiler emitted them (docs/AARCH64.md quotes this).
disasm-aarch64: $(A64_LIB)
	$(A64_OBJDUMP) -d -C --no-show-raw-insn $(A64_LIB) > $(A64_BUILD)/libpkm_tflite.dis
	@echo "wrote $(A64_BUILD)/libpkm_tflite.dis"

# arm64 Debian userland: debootstrap's first stage downloads the packages; they
# are unpacked with dpkg -x (no maintainer scripts: without binfmt_misc a chroot
# cannot run arm64 binaries, and Python needs none of them). qemu runs the
# binaries with -L $(A64_ROOT) so absolute paths resolve inside the root.
$(A64_ROOT_STAMP): tests/aarch64/cpuinfo-cortex-a53 | aarch64-tools
	rm -rf $(A64_ROOT) && mkdir -p $(A64_ROOT)
	debootstrap --foreign --arch=arm64 --variant=minbase \
	  --include=python3.11-minimal,libpython3.11-stdlib $(A64_SUITE) $(abspath $(A64_ROOT)) $(A64_MIRROR)
	for deb in $(A64_ROOT)/var/cache/apt/archives/*.deb; do dpkg -x "$$deb" $(A64_ROOT); done
	rm -f $(A64_ROOT)/var/cache/apt/archives/*.deb
	# qemu-user 7.2 shows the host's /proc/cpuinfo, which XNNPACK's CPU
	# detection cannot parse (it crashes); with -L, qemu opens this file instead.
	mkdir -p $(A64_ROOT)/proc && cp tests/aarch64/cpuinfo-cortex-a53 $(A64_ROOT)/proc/cpuinfo
	touch $@

# aarch64 wheels, pinned in tests/aarch64/requirements-<runtime>.txt.
$(A64_CACHE)/site-%/.installed: tests/aarch64/requirements-%.txt | aarch64-tools $(STAMP)
	rm -rf $(dir $@)
	$(PIP) install -q --disable-pip-version-check --no-deps --target $(dir $@) $(A64_PIP_TARGET) -r $<
	touch $@

aarch64-env: $(A64_ROOT_STAMP) $(foreach r,$(A64_RUNTIMES),$(A64_CACHE)/site-$(r)/.installed)

# QEMU_CPU: the oldest core qemu models (ARMv8.0-A + NEON); the library must run there.
A64_RUN := QEMU_CPU=cortex-a53 $(A64_QEMU) -L $(A64_ROOT)

core-test-aarch64: $(A64_CORE_TEST) $(A64_ROOT_STAMP)
	$(A64_RUN) $(A64_CORE_TEST)

test-aarch64: $(STAMP) $(TFLITE_LIB) $(A64_LIB) aarch64-env core-test-aarch64
	file -L $(A64_LIB)
	PKM_AARCH64_LIB=$(A64_LIB) PKM_AARCH64_CACHE=$(A64_CACHE) PKM_AARCH64_QEMU=$(A64_QEMU) \
	  $(PY) -m pytest -q tests/aarch64 $(PYTEST_ARGS)

# `make test` runs tests/aarch64 with the rest of the suite; this prepares them
# (first run on a fresh machine: 3-4 minutes, see docs/AARCH64.md).
aarch64-test-deps: $(A64_LIB) aarch64-env core-test-aarch64
TEST_DEPS += aarch64-test-deps

.PHONY: aarch64-test-deps aarch64-tools tflite-aarch64 core-test-aarch64 disasm-aarch64 aarch64-env test-aarch64
