// SIMT emulation: the fiber pool and switching. Fibers are created once with ucontext
// (makecontext) and reused for every block and launch; switches use _setjmp/_longjmp, ~25 ns
// against ~600 ns for swapcontext's signal-mask syscall. Under AddressSanitizer every switch is
// announced with __sanitizer_*_switch_fiber.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "simt_runtime.h"

#if SIMT_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace simt::detail {
namespace {
thread_local Runtime* tls = nullptr;
}  // namespace

Runtime& rt() {
  if (tls == nullptr) tls = new Runtime();  // one per OS thread, kept for the thread's life
  return *tls;
}

[[noreturn]] void fatal(const char* what) {
  std::fprintf(stderr, "simt: %s\n", what);
  std::abort();
}

std::string where(const Site& s) {
  std::string file = s.file_name();
  const size_t slash = file.rfind('/');
  if (slash != std::string::npos) file = file.substr(slash + 1);
  return file + ":" + std::to_string(s.line());
}

std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kSyncwarp: return "__syncwarp";
    case WarpOp::kShflIdx: return "__shfl_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kShflXor: return "__shfl_xor_sync";
    case WarpOp::kBallot: return "__ballot_sync";
  }
  return "?";
}

// "0-31, 64" for a sorted list of thread ids.
std::string ranges(const std::vector<int>& ids) {
  std::ostringstream out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (i) out << ", ";
    out << ids[i];
    if (j > i) out << "-" << ids[j];
    i = j + 1;
  }
  return out.str();
}

std::string block_name(const Runtime& r, uint3 b) {
  std::ostringstream out;
  out << "block (" << b.x << "," << b.y << "," << b.z << ") of " << r.kernel << " launched at "
      << where(r.config->site) << " [" << r.config->site.function_name() << "]";
  return out.str();
}

// ---- switching ----------------------------------------------------------------------------------

void before_switch(void** save, const void* bottom, size_t size) {
#if SIMT_ASAN
  __sanitizer_start_switch_fiber(save, bottom, size);
#else
  (void)save, (void)bottom, (void)size;
#endif
}

void after_switch_to_fiber(Fiber* f) {
#if SIMT_ASAN
  Runtime& r = rt();
  __sanitizer_finish_switch_fiber(f->fake_stack, &r.scheduler_stack, &r.scheduler_stack_size);
#else
  (void)f;
#endif
}

void after_switch_to_scheduler() {
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(rt().scheduler_fake_stack, nullptr, nullptr);
#endif
}

// From a fiber: save its context and continue the scheduler.
void to_scheduler(Fiber* f) {
  Runtime& r = rt();
  if (_setjmp(f->ctx) == 0) {
    before_switch(&f->fake_stack, r.scheduler_stack, r.scheduler_stack_size);
    _longjmp(r.scheduler, 1);
  }
  after_switch_to_fiber(f);
}

void fiber_main() {
  Fiber* const f = rt().starting;
  after_switch_to_fiber(f);
  // Restarts land here, with the aborted kernel's frames discarded.
  if (_setjmp(f->top) != 0) after_switch_to_fiber(f);
  for (;;) {
    f->state = State::kIdle;
    to_scheduler(f);
    (*rt().body)();
    f->state = State::kDone;
    thread_exited(f);
  }
}

// From the scheduler: run `f` (from `target`) until it blocks, ends or aborts.
void run_fiber(Fiber* f, jmp_buf* target) {
  Runtime& r = rt();
  r.current = f;
  if (_setjmp(r.scheduler) == 0) {
    before_switch(&r.scheduler_fake_stack, f->stack, kStackBytes);
    if (target == nullptr) {
      r.starting = f;
      setcontext(&f->start);
    }
    _longjmp(*target, 1);
  }
  after_switch_to_scheduler();
  r.current = nullptr;
}

Fiber* fiber(int i) {
  Runtime& r = rt();
  while (static_cast<int>(r.pool.size()) <= i) {
    auto f = std::make_unique<Fiber>();
    const long page = sysconf(_SC_PAGESIZE);
    void* mem = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) fatal("cannot map a fiber stack");
    mprotect(mem, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
    f->stack = static_cast<char*>(mem) + page;
    getcontext(&f->start);
    f->start.uc_stack.ss_sp = f->stack;
    f->start.uc_stack.ss_size = kStackBytes;
    f->start.uc_link = nullptr;
    makecontext(&f->start, fiber_main, 0);
    Fiber* raw = f.release();
    r.pool.push_back(raw);
    run_fiber(raw, nullptr);  // runs to its first wait, idle
  }
  return r.pool[i];
}

// ---- diagnostics ---------------------------------------------------------------------------------

// Records a diagnostic and ends the launch: the calling fiber never continues its kernel.
[[noreturn]] void abort_launch(const std::string& message) {
  Runtime& r = rt();
  Fiber* f = r.current;
  if (f == nullptr) fatal(message.c_str());
  r.diagnostics.push_back(message + " — in " + block_name(r, f->coords.block_idx));
  r.aborted = true;
  f->state = State::kBroken;
  to_scheduler(f);
  fatal("a broken fiber was resumed");
}

std::vector<int> lanes_of(unsigned mask) {
  std::vector<int> out;
  for (int l = 0; l < kWarp; ++l) {
    if (mask >> l & 1u) out.push_back(l);
  }
  return out;
}

// Lanes of warp `w` that exist and have not exited.
unsigned live_lanes(int w) { return rt().warps[w].live; }

void block_until_woken(Fiber* f, const char* what, Site site) {
  f->state = State::kWaiting;
  f->waiting_on = what;
  f->wait_site = site;
  to_scheduler(f);
}

}  // namespace simt::detail
