// `epmoe launch`: N local ranks with a shared NCCL unique id (epmoe/launch.hpp).
#include "epmoe/launch.hpp"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
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

std::vector<std::string> child_environment(const std::vector<std::pair<std::string, std::string>>& set) {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    bool replaced = false;
    for (const auto& [k, v] : set)
      if (kv.size() > k.size() && kv.substr(0, k.size()) == k && kv[k.size()] == '=') replaced = true;
    if (!replaced) env.emplace_back(kv);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  return env;
}

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& o) : o_(o) {
    if (!o_.on_line) {
      o_.on_line = [prefix_stdout = o_.prefix_stdout](int rank, bool is_stderr, std::string_view line) {
        std::string s = is_stderr || prefix_stdout ? fmt::format("[rank {}] {}\n", rank, line)
                                                   : fmt::format("{}\n", line);
        std::FILE* f = is_stderr ? stderr : stdout;
        std::fwrite(s.data(), 1, s.size(), f);
        std::fflush(f);
      };
    }
    if (!o_.on_note) {
      o_.on_note = [](std::string_view m) {
        std::string s = fmt::format("[launch] {}\n", m);
        std::fwrite(s.data(), 1, s.size(), stderr);
        std::fflush(stderr);
      };
    }
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
    EPMOE_CHECK(o_.timeout_s >= 0, "launch: timeout_s must be >= 0 seconds (0: no limit), got {}",
                o_.timeout_s);
    EPMOE_CHECK(o_.kill_grace_s >= 0, "launch: kill_grace_s must be >= 0 seconds, got {}", o_.kill_grace_s);

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
      const int err = spawn(r, child_environment(vars));
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
    } else if (interrupted_) {
      result.exit_code = 130;
    } else if (first_failed_ >= 0) {
      result.exit_code = ranks_[static_cast<std::size_t>(first_failed_ - o_.first_rank)].code;
      if (result.exit_code == 0) result.exit_code = 1;
    }
    if (remove_id_file) std::remove(result.id_file.c_str());
    return result;
  }

 private:
  int spawn(Rank& r, const std::vector<std::string>& env) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0) return errno;
    if (pipe2(err, O_CLOEXEC) != 0) {
      const int e = errno;
      close(out[0]);
      close(out[1]);
      return e;
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, err[1], STDERR_FILENO);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    for (int s : {SIGINT, SIGTERM, SIGPIPE, SIGHUP, SIGQUIT}) sigaddset(&defaults, s);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setpgroup(&attr, 0);  // its own process group: stopping it reaches its children
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

    std::vector<char*> argv, envp;
    for (const std::string& a : o_.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    pid_t pid = -1;
    const int rc = posix_spawnp(&pid, argv[0], &actions, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    close(out[1]);
    close(err[1]);
    if (rc != 0) {
      close(out[0]);
      close(err[0]);
      return rc;
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

  void loop() {
    Clock::time_point all_exited{};
    bool any_exited_all = false;
    while (true) {
      std::vector<pollfd> fds;
      std::vector<std::pair<Rank*, Stream*>> owners;
      for (Rank& r : ranks_)
        for (Stream* s : {&r.out, &r.err})
          if (s->fd >= 0) {
            fds.push_back({s->fd, POLLIN, 0});
            owners.emplace_back(&r, s);
          }
      bool running = false;
      for (const Rank& r : ranks_) running |= r.running;
      if (!running) {
        // Every rank has exited: read what is left, but do not wait for descendants that keep a
        // pipe open after their rank is gone.
        if (!any_exited_all) {
          any_exited_all = true;
          all_exited = Clock::now();
        }
        if (fds.empty() || Clock::now() - all_exited > std::chrono::milliseconds(200)) break;
      }
      if (!fds.empty()) {
        const int n = poll(fds.data(), fds.size(), 20);
        if (n > 0)
          for (std::size_t i = 0; i < fds.size(); ++i)
            if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) drain(*owners[i].first, *owners[i].second);
      } else {
        usleep(20000);
      }
      reap();
      const auto now = Clock::now();
      if (o_.interrupted != nullptr && *o_.interrupted && !stopping_) {
        interrupted_ = true;
        stop_all("interrupted; stopping every rank");
      }
      if (o_.timeout_s > 0 && !stopping_ && now - start_ > std::chrono::duration<double>(o_.timeout_s)) {
        timed_out_ = true;
        stop_all(fmt::format("timed out after {:.1f} s; stopping every rank", o_.timeout_s));
      }
      if (stopping_ && now > kill_at_) signal_all(SIGKILL);
    }
    for (Rank& r : ranks_)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          emit(r, *s, true);
          close(s->fd);
          s->fd = -1;
        }
  }

  LaunchOptions o_;
  std::vector<Rank> ranks_;
  Clock::time_point start_{}, kill_at_{};
  bool stopping_ = false, timed_out_ = false, interrupted_ = false, write_id_after_spawn_ = false;
  int first_failed_ = -1;
};

}  // namespace

LaunchResult launch_ranks(const LaunchOptions& options) {
  return Launcher(options).run();
}

}  // namespace epmoe
