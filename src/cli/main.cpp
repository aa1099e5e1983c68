// `dtune` entry point: dispatches to subcommands and turns exceptions into one clear message and
// an exit code (see core/error.h for the codes).
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>

#include "cli/command.h"
#include "cli/version.h"
#include "core/error.h"
#include "core/fused_env.h"
#include "core/log.h"
#include "core/redact.h"
#include "io/image.h"

namespace dtune::cli {

std::vector<Command>& commands() {
    static std::vector<Command> all;
    return all;
}

const Command* find_command(const std::string& name) {
    for (const auto& c : commands())
        if (c.name == name) return &c;
    return nullptr;
}

bool wants_help(const std::vector<std::string>& args) {
    return std::any_of(args.begin(), args.end(),
                       [](const std::string& a) { return a == "-h" || a == "--help"; });
}

namespace {

void print_help() {
    std::printf(
        "dtune %s - fine-tune diffusion models (SDXL) natively on libtorch\n\n"
        "usage: dtune <command> [options]     dtune <command> --help for details\n\n"
        "commands:\n",
        kVersion);
    auto sorted = commands();
    std::sort(sorted.begin(), sorted.end(),
              [](const Command& a, const Command& b) { return a.name < b.name; });
    for (const auto& c : sorted) std::printf("  %-12s %s\n", c.name.c_str(), c.summary.c_str());
    std::printf(
        "\noptions:\n"
        "  --version    print the version and build details\n"
        "  --log_level  debug|info|warn|error (also DTUNE_LOG_LEVEL)\n\n"
        "exit codes: 0 ok, 1 error, 2 bad usage/config, 3 bad data or model files,\n"
        "            4 interrupted (state saved), 75 GPU fault (replace the machine)\n");
}

}  // namespace
}  // namespace dtune::cli

int main(int argc, char** argv) {
    using namespace dtune;
    // A write to a socket or pipe whose reader is gone (a rank that died mid-collective, a store
    // whose host ended, a closed webhook connection) must fail with EPIPE, which the caller
    // reports, not kill the process with SIGPIPE before it can say what happened. (Python ignores
    // SIGPIPE at start-up, so PyTorch's own collectives never meet it; `dtune launch` restores the
    // default for the programs it starts.)
    std::signal(SIGPIPE, SIG_IGN);
    std::vector<std::string> args(argv + 1, argv + argc);
    if (const char* env = std::getenv("DTUNE_LOG_LEVEL"))
        if (auto lvl = log::parse_level(env)) log::set_level(*lvl);
    // --log_level may appear anywhere; take it out before dispatching.
    for (std::size_t i = 0; i + 1 < args.size(); ++i) {
        if (args[i] == "--log_level") {
            auto lvl = log::parse_level(args[i + 1]);
            if (!lvl) {
                std::fprintf(stderr, "error: --log_level '%s' is not one of debug, info, warn, error\n",
                             args[i + 1].c_str());
                return static_cast<int>(ExitCode::kUsage);
            }
            log::set_level(*lvl);
            args.erase(args.begin() + static_cast<long>(i), args.begin() + static_cast<long>(i) + 2);
            break;
        }
    }
    if (args.empty() || args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
        if (args.size() >= 2 && cli::find_command(args[1])) {
            std::printf("%s", cli::find_command(args[1])->usage.c_str());
            return 0;
        }
        cli::print_help();
        return args.empty() ? static_cast<int>(ExitCode::kUsage) : 0;
    }
    if (args[0] == "--version" || args[0] == "-V") args[0] = "version";

    const cli::Command* cmd = cli::find_command(args[0]);
    if (!cmd) {
        std::fprintf(stderr, "error: unknown command '%s'; run `dtune --help` for the list\n",
                     args[0].c_str());
        return static_cast<int>(ExitCode::kUsage);
    }
    std::vector<std::string> rest(args.begin() + 1, args.end());
    if (cli::wants_help(rest)) {
        std::printf("%s", cmd->usage.c_str());
        return 0;
    }
    try {
        // Checked up front, so a bad value fails here rather than at the first fused kernel.
        if (!fused_kernels_allowed())
            log::info() << "DTUNE_FUSED_KERNELS=" << std::getenv("DTUNE_FUSED_KERNELS")
                        << ": dtune's fused kernels are off (ATen's ops run instead)";
        io::max_image_pixels();  // DTUNE_MAX_IMAGE_PIXELS: a bad value stops here, not in a decode worker
        return cmd->run(rest);
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", redact_text(e.what()).c_str());
        return static_cast<int>(e.code());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", redact_text(e.what()).c_str());
        return static_cast<int>(ExitCode::kError);
    }
}
