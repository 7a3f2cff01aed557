// `epmoe launch`: N local ranks with a shared NCCL unique id (epmoe/launch.hpp).
#include "epmoe/launch.hpp"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "epmoe/comm.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "epmoe/error.hpp"

extern char** environ;

namespace epmoe {
std::vector<std::string> launch_gpu_ids(const char* cuda_visible_devices, int listed) {
  std::vector<std::string> ids;
  if (cuda_visible_devices != nullptr) {
    std::string_view rest(cuda_visible_devices);
    while (!rest.empty()) {
      const std::size_t comma = rest.find(',');
      std::string_view entry = rest.substr(0, comma);
      while (!entry.empty() && entry.front() == ' ') entry.remove_prefix(1);
      while (!entry.empty() && entry.back() == ' ') entry.remove_suffix(1);
      if (!entry.empty() && entry.front() == '-') break;  // "-1": CUDA sees no GPU from here on
      if (!entry.empty()) ids.emplace_back(entry);
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    return ids;
  }
  for (int i = 0; i < listed; ++i) ids.push_back(std::to_string(i));
  return ids;
}

namespace {

using Clock = std::chrono::steady_clock;

struct Stream {
  int fd = -1;
  bool is_stderr = false;
  std::string pending;  // bytes after the last newline
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int code = -1;
  Stream out, err;
};

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The launcher's environment with `set` replacing (or adding) its variables and `unset` removed.
std::vector<std::string> child_environment(const std::vector<std::pair<std::string, std::string>>& set,
                                           const std::vector<std::string>& unset) {
  const auto names = [](std::string_view kv, std::string_view k) {
    return kv.size() > k.size() && kv.substr(0, k.size()) == k && kv[k.size()] == '=';
  };
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    bool dropped = false;
    for (const auto& [k, v] : set) dropped |= names(kv, k);
    for (const std::string& k : unset) dropped |= names(kv, k);
    if (!dropped) env.emplace_back(kv);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  return env;
}

// The program `name` runs: itself when it has a slash, else the first executable regular file of that
// name on PATH (as execvp searches, done before fork: the child may only make async-signal-safe calls).
// Empty when there is none.
std::string resolve_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path_env = std::getenv("PATH");
  const std::string_view path(path_env != nullptr && *path_env != '\0' ? path_env
                                                                       : "/usr/local/bin:/usr/bin:/bin");
  std::size_t start = 0;
  while (start <= path.size()) {
    const std::size_t colon = std::min(path.find(':', start), path.size());
    const std::string dir(path.substr(start, colon - start));
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(candidate.c_str(), X_OK) == 0)
      return candidate;
    start = colon + 1;
  }
  return {};
}

// What the ranks print, on its way to one of the launcher's own descriptors (stdout or stderr) without
// ever blocking the launcher: a reader that stops reading must not stop its timeout, its signals or its
// reaping. Written as far as the descriptor takes it; the launcher stops reading the ranks' pipes while
// too much waits here (the ranks then block on their writes, as on any pipe).
struct Sink {
  int fd = -1;
  std::string buffer;
  std::size_t sent = 0;      // bytes of `buffer` already written
  bool broken = false;       // the descriptor failed: what comes is dropped
  bool reader_gone = false;  // ... because its reader went away (EPIPE)

  std::size_t pending() const { return buffer.size() - sent; }
  void add(std::string_view text) {
    if (!broken) buffer.append(text);
  }
  // Writes what the descriptor takes now, PIPE_BUF bytes at a time (a write of at most PIPE_BUF to a
  // pipe that polls writable does not block).
  void pump() {
    while (pending() > 0 && !broken) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, 0) <= 0) break;
      if ((p.revents & POLLNVAL) != 0) {  // not open (`>&-`): dropped, as a write to it would be
        broken = true;
        break;
      }
      if ((p.revents & (POLLOUT | POLLERR | POLLHUP)) == 0) break;
      const ssize_t n = ::write(fd, buffer.data() + sent, std::min<std::size_t>(pending(), PIPE_BUF));
      if (n > 0) {
        sent += static_cast<std::size_t>(n);
      } else if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
        break;
      } else {
        broken = true;
        reader_gone = n < 0 && errno == EPIPE;
      }
    }
    if (broken || sent == buffer.size() || sent > (std::size_t{1} << 20)) {
      buffer.erase(0, broken ? buffer.size() : sent);
      sent = 0;
    }
  }
};

constexpr double kMaxKillGraceS = 86400.0;

// Output held for the launcher's descriptors before it stops reading the ranks' pipes.
constexpr std::size_t kMaxHeldOutput = std::size_t{8} << 20;

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& o) : o_(o) {
    if (!o_.on_line) {
      std::fflush(stdout);  // what this process printed before comes first
      std::fflush(stderr);
      o_.on_line = [this](int rank, bool is_stderr, std::string_view line) {
        (is_stderr ? err_ : out_)
            .add(is_stderr || o_.prefix_stdout ? fmt::format("[rank {}] {}\n", rank, line)
                                               : fmt::format("{}\n", line));
      };
    }
    if (!o_.on_note) o_.on_note = [this](std::string_view m) { err_.add(fmt::format("[launch] {}\n", m)); };
  }

  LaunchResult run() {
    EPMOE_CHECK(!o_.command.empty(), "launch: no command given (usage: epmoe launch -n N -- <command...>)");
    EPMOE_CHECK(o_.num_ranks >= 1, "launch: -n must be at least 1, got {}", o_.num_ranks);
    EPMOE_CHECK(o_.world_size >= 0, "launch: world_size must be >= 0 (0: num_ranks), got {}", o_.world_size);
    const int world = o_.world_size > 0 ? o_.world_size : o_.num_ranks;
    EPMOE_CHECK(o_.first_rank >= 0 && o_.first_rank + o_.num_ranks <= world,
                "launch: ranks [{}, {}) do not fit in a world of {}", o_.first_rank,
                o_.first_rank + o_.num_ranks, world);
    // (Written so that nan fails too.)
    EPMOE_CHECK(o_.timeout_s >= 0 && std::isfinite(o_.timeout_s),
                "launch: timeout_s must be >= 0 seconds (0: no limit), got {}", o_.timeout_s);
    // (A day at most: the grace is added to the clock's integer nanoseconds, which a grace past ~292
    // years overflowed into none at all.)
    EPMOE_CHECK(o_.kill_grace_s >= 0 && o_.kill_grace_s <= kMaxKillGraceS,
                "launch: kill_grace_s must be in [0, {}] seconds, got {}", kMaxKillGraceS, o_.kill_grace_s);

    LaunchResult result;
    bool remove_id_file = false;
    if (o_.first_rank == 0) {
      std::string path = o_.id_file;
      if (path.empty()) {
        const char* tmp = std::getenv("TMPDIR");
        std::string pattern = std::string(tmp != nullptr && *tmp ? tmp : "/tmp") + "/epmoe-nccl-id-XXXXXX";
        const int fd = mkstemp(pattern.data());
        EPMOE_CHECK(fd >= 0, "launch: cannot create a temporary id file '{}': {}", pattern,
                    std::strerror(errno));
        close(fd);
        path = pattern;
        remove_id_file = true;
      } else {
        // Empty until the id is in it (the ranks wait for that; a stale id from an earlier launch
        // must not be read).
        std::FILE* f = std::fopen(path.c_str(), "w");
        EPMOE_CHECK(f != nullptr, "launch: cannot write the id file '{}': {}", path, std::strerror(errno));
        std::fclose(f);
      }
      result.id_file = path;
      write_id_after_spawn_ = true;
      // The ranks read a fresh id from the file; an inherited EPMOE_NCCL_ID (an earlier job's) would take
      // precedence over it in Communicator::from_environment and lead them to a bootstrap root that is gone.
      unset_.emplace_back("EPMOE_NCCL_ID");
      if (std::getenv("EPMOE_NCCL_ID") != nullptr)
        o_.on_note(
            "EPMOE_NCCL_ID in the environment ignored: this launcher hosts rank 0 and writes a fresh id");
    } else {
      EPMOE_CHECK(
          !o_.id_file.empty() || std::getenv("EPMOE_NCCL_ID") != nullptr,
          "launch: ranks from {} on need the id of rank 0's launcher: pass --id-file (on a shared file "
          "system) or set EPMOE_NCCL_ID",
          o_.first_rank);
      result.id_file = o_.id_file;
    }
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    if (nvls != nullptr && std::string_view(nvls) != "0")
      o_.on_note(fmt::format("NCCL_NVLS_ENABLE={} overridden: the ranks run with NCCL_NVLS_ENABLE=0", nvls));

    // One GPU per rank where there are enough (LaunchOptions::one_gpu_per_rank). Counted without
    // initialising CUDA here: the parent would pay the start-up the ranks are spared.
    std::vector<std::string> gpus;
    if (o_.one_gpu_per_rank) {
      gpus = launch_gpu_ids(std::getenv("CUDA_VISIBLE_DEVICES"), cuda::listed_gpu_count());
      if (static_cast<int>(gpus.size()) < o_.num_ranks) gpus.clear();
    }

    start_ = Clock::now();
    ranks_.resize(static_cast<std::size_t>(o_.num_ranks));
    for (int i = 0; i < o_.num_ranks; ++i) {
      Rank& r = ranks_[static_cast<std::size_t>(i)];
      r.rank = o_.first_rank + i;
      std::vector<std::pair<std::string, std::string>> vars{
          {"EPMOE_RANK", std::to_string(r.rank)},
          {"EPMOE_WORLD_SIZE", std::to_string(world)},
          {"EPMOE_LOCAL_RANK", std::to_string(i)},
          {"EPMOE_LOCAL_WORLD_SIZE", std::to_string(o_.num_ranks)},
          {"NCCL_NVLS_ENABLE", "0"},
      };
      if (!result.id_file.empty()) vars.emplace_back("EPMOE_NCCL_ID_FILE", result.id_file);
      if (!gpus.empty()) {
        vars.emplace_back("CUDA_VISIBLE_DEVICES", gpus[static_cast<std::size_t>(i)]);
        vars.emplace_back("EPMOE_LOCAL_DEVICE", "0");
        vars.emplace_back("EPMOE_ONE_GPU_PER_RANK", "1");
      } else {
        vars.emplace_back("EPMOE_LOCAL_DEVICE", std::to_string(i));
        vars.emplace_back("EPMOE_ONE_GPU_PER_RANK", "0");
      }
      const int err = spawn(r, child_environment(vars, unset_));
      if (err != 0) {
        o_.on_note(fmt::format("cannot start rank {} ('{}'): {}", r.rank, o_.command[0], std::strerror(err)));
        r.code = 127;
        on_failure(r);
        break;
      }
    }
    if (write_id_after_spawn_ && !stopping_) {
      // The id after the ranks are started: ncclGetUniqueId (NCCL's own initialisation, the
      // bootstrap root in this process) then overlaps their process and CUDA start-up; they poll the
      // file, which the rename below fills in one step.
      try {
        write_nccl_id_file(result.id_file, new_nccl_id());
      } catch (const std::exception& e) {
        first_failed_ = o_.first_rank;
        stop_all(fmt::format("cannot create the NCCL id: {}; stopping every rank", e.what()));
      }
    }
    loop();

    result.exit_code = 0;
    for (const Rank& r : ranks_) result.rank_codes.push_back(r.code);
    result.timed_out = timed_out_;
    result.first_failed_rank = first_failed_;
    if (timed_out_) {
      result.exit_code = 124;
    } else if (interrupt_signal_ != 0) {
      result.exit_code =
          128 + (interrupt_signal_ > 0 && interrupt_signal_ < 128 ? interrupt_signal_ : SIGINT);
    } else if (output_broken_) {
      result.exit_code = 128 + SIGPIPE;
    } else if (first_failed_ >= 0) {
      result.exit_code = ranks_[static_cast<std::size_t>(first_failed_ - o_.first_rank)].code;
      if (result.exit_code == 0) result.exit_code = 1;
    }
    if (remove_id_file) std::remove(result.id_file.c_str());
    return result;
  }

 private:
  // fork and exec rather than posix_spawn, for what only the child can set up: its death signal
  // (PR_SET_PDEATHSIG: a launcher that dies, even by SIGKILL, takes its ranks with it instead of
  // leaving them running on the GPUs) and /dev/null as its stdin (a rank in a background process group
  // that read the terminal would be stopped by SIGTTIN for ever). Between fork and exec the child makes
  // async-signal-safe calls only; an exec failure comes back through a close-on-exec pipe.
  int spawn(Rank& r, const std::vector<std::string>& env) {
    const std::string program = resolve_program(o_.command[0]);
    if (program.empty()) return ENOENT;
    std::vector<char*> argv, envp;
    for (const std::string& a : o_.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);

    int out[2] = {-1, -1}, err[2] = {-1, -1}, status_pipe[2] = {-1, -1};
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 || pipe2(status_pipe, O_CLOEXEC) != 0) {
      const int e = errno;
      for (int fd : {out[0], out[1], err[0], err[1]})  // (a failed pipe2 leaves its pair at -1)
        if (fd >= 0) close(fd);
      return e;
    }
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid == 0) {
      // The child: its own process group (stopping it reaches its children), the signals a rank
      // expects, its descriptors, then the program.
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the launcher died before the death signal was set
      struct sigaction defaults {};
      defaults.sa_handler = SIG_DFL;
      sigemptyset(&defaults.sa_mask);
      static constexpr int kDefaultSignals[] = {SIGINT, SIGTERM, SIGPIPE, SIGHUP, SIGQUIT};
      for (int sig : kDefaultSignals) sigaction(sig, &defaults, nullptr);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (null_fd >= 0 && dup2(null_fd, STDIN_FILENO) >= 0 && dup2(out[1], STDOUT_FILENO) >= 0 &&
          dup2(err[1], STDERR_FILENO) >= 0)
        execve(program.c_str(), argv.data(), envp.data());
      const int e = errno;
      (void)!write(status_pipe[1], &e, sizeof(e));
      _exit(127);
    }
    const int fork_errno = errno;
    close(out[1]);
    close(err[1]);
    close(status_pipe[1]);
    if (pid < 0) {
      for (int fd : {out[0], err[0], status_pipe[0]}) close(fd);
      return fork_errno;
    }
    setpgid(pid, pid);  // (also here: no signal to the group can come before the child's own call)
    int exec_errno = 0;
    ssize_t n = 0;
    do {
      n = read(status_pipe[0], &exec_errno, sizeof(exec_errno));
    } while (n < 0 && errno == EINTR);
    close(status_pipe[0]);
    if (n == static_cast<ssize_t>(sizeof(exec_errno))) {  // exec failed: nothing ran
      int status = 0;
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      close(out[0]);
      close(err[0]);
      return exec_errno != 0 ? exec_errno : ENOEXEC;
    }
    r.pid = pid;
    r.running = true;
    r.out = {out[0], false, {}};
    r.err = {err[0], true, {}};
    return 0;
  }

  void emit(const Rank& r, Stream& s, bool flush) {
    std::size_t start = 0;
    while (true) {
      const std::size_t nl = s.pending.find('\n', start);
      if (nl == std::string::npos) break;
      o_.on_line(r.rank, s.is_stderr, std::string_view(s.pending).substr(start, nl - start));
      start = nl + 1;
    }
    s.pending.erase(0, start);
    if (flush && !s.pending.empty()) {
      o_.on_line(r.rank, s.is_stderr, s.pending);
      s.pending.clear();
    }
  }

  // Reads what is there; returns false at end of file (and closes the descriptor).
  bool drain(Rank& r, Stream& s) {
    char buf[65536];
    const ssize_t n = read(s.fd, buf, sizeof(buf));
    if (n > 0) {
      s.pending.append(buf, static_cast<std::size_t>(n));
      emit(r, s, false);
      return true;
    }
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    emit(r, s, true);
    close(s.fd);
    s.fd = -1;
    return false;
  }

  void signal_all(int sig) {
    for (Rank& r : ranks_)
      if (r.running) kill(-r.pid, sig);
  }

  void stop_all(const std::string& why) {
    if (stopping_) return;
    stopping_ = true;
    if (!why.empty()) o_.on_note(why);
    signal_all(SIGTERM);
    kill_at_ = Clock::now() +
               std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.kill_grace_s));
  }

  void on_failure(const Rank& r) {
    if (first_failed_ >= 0 || stopping_) return;
    first_failed_ = r.rank;
    bool others = false;
    for (const Rank& x : ranks_) others |= x.running;
    stop_all(fmt::format("rank {} {}{}", r.rank,
                         r.code > 128 ? fmt::format("was killed by signal {}", r.code - 128)
                                      : fmt::format("exited with code {}", r.code),
                         others ? "; stopping the other ranks" : ""));
  }

  void reap() {
    for (Rank& r : ranks_) {
      if (!r.running) continue;
      int status = 0;
      const pid_t p = waitpid(r.pid, &status, WNOHANG);
      if (p != r.pid) continue;
      r.running = false;
      r.code = decode_status(status);
      if (stopping_) kill(-r.pid, SIGKILL);  // whatever it left in its group
      if (r.code != 0) on_failure(r);
    }
  }

  std::size_t held_output() const { return out_.pending() + err_.pending(); }
  // Timed out, interrupted or nobody reading: what the ranks printed is not worth waiting for.
  bool giving_up() const { return timed_out_ || interrupt_signal_ != 0 || output_broken_; }

  void check_interrupt_and_timeout() {
    const auto now = Clock::now();
    if (o_.interrupted != nullptr && *o_.interrupted != 0 && !stopping_) {
      interrupt_signal_ = static_cast<int>(*o_.interrupted);
      stop_all(fmt::format("interrupted{}; stopping every rank",
                           interrupt_signal_ > 0 && interrupt_signal_ < 128
                               ? fmt::format(" (signal {})", interrupt_signal_)
                               : std::string()));
    }
    if (o_.timeout_s > 0 && !stopping_ && now - start_ > std::chrono::duration<double>(o_.timeout_s)) {
      timed_out_ = true;
      stop_all(fmt::format("timed out after {:.1f} s; stopping every rank", o_.timeout_s));
    }
    if (stopping_ && now > kill_at_) signal_all(SIGKILL);
  }

  void pump_output() {
    out_.pump();
    err_.pump();
    if ((out_.reader_gone || err_.reader_gone) && !output_broken_) {
      output_broken_ = true;  // the reader of the launcher's output is gone (`| head`): nobody sees more
      stop_all("the launcher's output was closed; stopping every rank");
    }
  }

  void loop() {
    Clock::time_point all_exited{};
    bool any_exited_all = false;
    while (true) {
      std::vector<pollfd> fds;
      std::vector<std::pair<Rank*, Stream*>> owners;
      const bool reading = held_output() < kMaxHeldOutput;
      for (Rank& r : ranks_)
        for (Stream* s : {&r.out, &r.err})
          if (s->fd >= 0 && reading) {
            fds.push_back({s->fd, POLLIN, 0});
            owners.emplace_back(&r, s);
          }
      const std::size_t rank_fds = fds.size();
      for (const Sink* sink : {&out_, &err_})
        if (sink->pending() > 0 && !sink->broken) fds.push_back({sink->fd, POLLOUT, 0});
      bool running = false, open_pipes = false;
      for (const Rank& r : ranks_) {
        running |= r.running;
        open_pipes |= r.out.fd >= 0 || r.err.fd >= 0;
      }
      if (!running) {
        // Every rank has exited: read what is left, but do not wait for descendants that keep a
        // pipe open after their rank is gone. (The 200 ms count while the pipes are read: held back
        // by a slow reader, what the ranks left in them is not dropped, unless the launch gives up.)
        if (!any_exited_all || (!reading && !giving_up())) {
          any_exited_all = true;
          all_exited = Clock::now();
        }
        if (!open_pipes || Clock::now() - all_exited > std::chrono::milliseconds(200)) break;
      }
      if (!fds.empty()) {
        const int n = poll(fds.data(), fds.size(), 20);
        if (n > 0)
          for (std::size_t i = 0; i < rank_fds; ++i)
            if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) drain(*owners[i].first, *owners[i].second);
      } else {
        usleep(20000);
      }
      pump_output();
      reap();
      check_interrupt_and_timeout();
    }
    for (Rank& r : ranks_)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          emit(r, *s, true);
          close(s->fd);
          s->fd = -1;
        }
    flush_output();
  }

  // What the ranks printed, to its end: as long as the reader takes it when the launch ended by itself
  // (a slow reader, `| less`, still gets everything); within the timeout when there is one; a second
  // more after an interrupt or a timeout, and then it is dropped.
  void flush_output() {
    Clock::time_point deadline{};
    while ((out_.pending() > 0 && !out_.broken) || (err_.pending() > 0 && !err_.broken)) {
      check_interrupt_and_timeout();
      const auto now = Clock::now();
      if (giving_up()) {
        if (deadline == Clock::time_point{}) deadline = now + std::chrono::seconds(1);
        if (now > deadline) break;
      }
      std::vector<pollfd> fds;
      for (const Sink* sink : {&out_, &err_})
        if (sink->pending() > 0 && !sink->broken) fds.push_back({sink->fd, POLLOUT, 0});
      poll(fds.data(), fds.size(), 20);
      pump_output();
    }
  }

  LaunchOptions o_;
  std::vector<Rank> ranks_;
  Clock::time_point start_{}, kill_at_{};
  bool stopping_ = false, timed_out_ = false, write_id_after_spawn_ = false, output_broken_ = false;
  int first_failed_ = -1;
  int interrupt_signal_ = 0;        // non-zero: interrupted (LaunchOptions::interrupted's value)
  std::vector<std::string> unset_;  // variables the ranks do not inherit
  Sink out_{STDOUT_FILENO}, err_{STDERR_FILENO};
};

}  // namespace

LaunchResult launch_ranks(const LaunchOptions& options) {
  return Launcher(options).run();
}

}  // namespace epmoe
