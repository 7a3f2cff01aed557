// One-time host set-up of a kernel (raising its dynamic shared-memory limit, choosing its carveout,
// querying its occupancy), registered when the library loads and run on demand for every registered
// kernel at once (prepare_kernels), not at the kernel's first launch.
//
// Why: cudaFuncSetAttribute may wait for the context's outstanding copies (observed by others:
// intel/llvm#16928). At a first launch in the middle of a forward that is harmless for one rank per
// GPU, but loopback ranks (threads of one process sharing a context) deadlock on it: a rank blocked
// there waits for a peer's copy queued behind the peer's kernel, which waits for this rank (the
// loopback timeout of the first W4A8 forward, bench/NOTES.md session 22). Communicator::create_loopback
// runs prepare_kernels() before any rank's first call. Each kernel's launcher still runs its own
// set-up once before its first launch (cheap after prepare_kernels).
#pragma once

#include <cstddef>
#include <functional>

namespace epmoe::cuda {

// Adds a set-up to the registry (call from static initialisers; returns true so that it can
// initialise a static). `what` names it in errors.
bool register_kernel_setup(const char* what, std::function<void()> setup);

// Runs every registered set-up on the current device, once per device (later calls return at once).
void prepare_kernels();

// How many set-ups are registered (tests).
std::size_t kernel_setup_count();

}  // namespace epmoe::cuda
