// The `dtune` subcommand registry. Each subcommand lives in its own cmd_<name>.cpp and registers
// itself with DTUNE_REGISTER_COMMAND, so adding one touches no other file.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace dtune::cli {

struct Command {
    std::string name;
    std::string summary;  // one line for `dtune --help`
    std::string usage;    // full text for `dtune <name> --help`
    // Receives the arguments after the subcommand name; returns the process exit code.
    std::function<int(const std::vector<std::string>& args)> run;
};

std::vector<Command>& commands();
const Command* find_command(const std::string& name);

struct Registrar {
    explicit Registrar(Command command) { commands().push_back(std::move(command)); }
};

// True when args contain -h or --help.
bool wants_help(const std::vector<std::string>& args);

}  // namespace dtune::cli

#define DTUNE_REGISTER_COMMAND(ident, ...)                       \
    static const ::dtune::cli::Registrar dtune_command_##ident { \
        ::dtune::cli::Command {                                  \
            __VA_ARGS__                                          \
        }                                                        \
    }
