// `dtune launch` configuration: the YAML subset reader, accelerate's fields, flag parsing and the
// consistency checks (see launch_config.h).
#include "dist/launch_config.h"

#include <cerrno>
#include <cstdlib>
#include <sstream>

#include "core/error.h"

namespace dtune::dist {
namespace {

std::string trim(const std::string& s) {
    auto b = s.find_first_not_of(" \t\r");
    if (b == std::string::npos) return "";
    auto e = s.find_last_not_of(" \t\r");
    return s.substr(b, e - b + 1);
}

// Drops a trailing `# comment` that is outside quotes.
std::string strip_comment(const std::string& line) {
    char quote = 0;
    for (std::size_t i = 0; i < line.size(); ++i) {
        char c = line[i];
        if (quote) {
            if (c == quote) quote = 0;
        } else if (c == '"' || c == '\'') {
            quote = c;
        } else if (c == '#' && (i == 0 || line[i - 1] == ' ' || line[i - 1] == '\t')) {
            return line.substr(0, i);
        }
    }
    return line;
}

std::string unquote(const std::string& v) {
    if (v.size() >= 2 && (v.front() == '"' || v.front() == '\'') && v.back() == v.front())
        return v.substr(1, v.size() - 2);
    return v;
}

std::optional<long> to_long(const std::string& text) {
    errno = 0;
    char* end = nullptr;
    long v = std::strtol(text.c_str(), &end, 10);
    if (errno != 0 || end == text.c_str() || *end != '\0') return std::nullopt;
    return v;
}

}  // namespace

std::map<std::string, std::string> parse_simple_yaml(const std::string& text, const std::string& origin) {
    std::map<std::string, std::string> out;
    // (indent, key) of the open mappings enclosing the current line.
    std::vector<std::pair<std::size_t, std::string>> parents;
    std::istringstream in(text);
    std::string raw;
    int line_no = 0;
    while (std::getline(in, raw)) {
        ++line_no;
        std::string line = strip_comment(raw);
        if (trim(line).empty() || trim(line) == "---") continue;
        std::size_t indent = line.find_first_not_of(' ');
        if (line[indent] == '\t')
            throw UsageError(
                str(origin, ":", line_no, ": tab indentation; YAML needs spaces, replace the tabs"));
        std::string body = trim(line);
        while (!parents.empty() && parents.back().first >= indent) parents.pop_back();
        if (body.front() == '-') continue;  // list items (e.g. gpu_ids lists, dynamo options): unused
        auto colon = body.find(':');
        if (colon == std::string::npos || colon == 0)
            throw UsageError(str(origin, ":", line_no, ": '", body, "' is not a `key: value` line; ",
                                 "dtune reads accelerate's flat config file (keys, nested mappings)"));
        std::string key = trim(body.substr(0, colon));
        std::string value = trim(body.substr(colon + 1));
        std::string full;
        for (const auto& [_, parent] : parents) full += parent + ".";
        full += unquote(key);
        if (value.empty() || value == "{}") {
            parents.emplace_back(indent, unquote(key));
            if (value == "{}") parents.pop_back();
            continue;
        }
        out[full] = unquote(value);
    }
    return out;
}

namespace {

std::optional<int> get_int(const std::map<std::string, std::string>& kv, const std::string& key,
                           const std::string& path) {
    auto it = kv.find(key);
    if (it == kv.end() || it->second == "null" || it->second == "~") return std::nullopt;
    auto v = to_long(it->second);
    if (!v || *v < 0 || *v > 1 << 30)
        throw UsageError(
            str(path, ": ", key, ": '", it->second, "' is not a non-negative integer; fix the value"));
    return static_cast<int>(*v);
}

std::optional<std::string> get_str(const std::map<std::string, std::string>& kv, const std::string& key) {
    auto it = kv.find(key);
    if (it == kv.end() || it->second == "null" || it->second == "~") return std::nullopt;
    return it->second;
}

}  // namespace

AccelerateConfig parse_accelerate_config(const std::string& text, const std::string& path) {
    auto kv = parse_simple_yaml(text, path);
    AccelerateConfig c;
    c.machine_rank = get_int(kv, "machine_rank", path);
    c.num_machines = get_int(kv, "num_machines", path);
    c.num_processes = get_int(kv, "num_processes", path);
    c.main_process_ip = get_str(kv, "main_process_ip");
    c.main_process_port = get_int(kv, "main_process_port", path);
    c.mixed_precision = get_str(kv, "mixed_precision");
    c.distributed_type = get_str(kv, "distributed_type");
    c.zero_stage = get_int(kv, "deepspeed_config.zero_stage", path);
    c.offload_optimizer_device = get_str(kv, "deepspeed_config.offload_optimizer_device");
    if (c.offload_optimizer_device && *c.offload_optimizer_device != "none" &&
        *c.offload_optimizer_device != "cpu")
        throw UsageError(str(path, ": deepspeed_config.offload_optimizer_device: '",
                             *c.offload_optimizer_device,
                             "' is not supported; dtune offloads optimizer state to the cpu (or none)"));
    c.gradient_accumulation_steps = get_int(kv, "deepspeed_config.gradient_accumulation_steps", path);
    if (!c.gradient_accumulation_steps)
        c.gradient_accumulation_steps = get_int(kv, "gradient_accumulation_steps", path);
    auto clip = get_str(kv, "deepspeed_config.gradient_clipping");
    if (!clip) clip = get_str(kv, "gradient_clipping");
    if (clip) {
        char* end = nullptr;
        double v = std::strtod(clip->c_str(), &end);
        if (end == clip->c_str() || *end != '\0' || v < 0)
            throw UsageError(str(path, ": gradient_clipping: '", *clip, "' is not a non-negative number"));
        c.gradient_clipping = v;
    }
    if (c.mixed_precision && *c.mixed_precision != "no" && *c.mixed_precision != "fp16" &&
        *c.mixed_precision != "bf16")
        throw UsageError(
            str(path, ": mixed_precision: '", *c.mixed_precision, "' is not one of no, fp16, bf16"));
    if (c.distributed_type) {
        const std::string& t = *c.distributed_type;
        if (t != "NO" && t != "MULTI_GPU" && t != "DEEPSPEED" && t != "MULTI_CPU")
            throw UsageError(str(
                path, ": distributed_type: '", t, "' is not supported; dtune runs NO, MULTI_GPU, ",
                "MULTI_CPU and DEEPSPEED (ZeRO stages 1-3 on its own engine; for FSDP set DEEPSPEED with ",
                "deepspeed_config.zero_stage 3, or fsdp_enable in config.json) - set one of these"));
    }
    if (c.zero_stage && (*c.zero_stage < 0 || *c.zero_stage > 3))
        throw UsageError(
            str(path, ": deepspeed_config.zero_stage: ", *c.zero_stage,
                " is not a ZeRO stage; dtune shards optimizer state (1), gradients (2) and parameters (3): ",
                "use 0 to 3"));
    c.offload_param_device = get_str(kv, "deepspeed_config.offload_param_device");
    if (c.offload_param_device && *c.offload_param_device != "none" && *c.offload_param_device != "cpu")
        throw UsageError(str(path, ": deepspeed_config.offload_param_device: '", *c.offload_param_device,
                             "' is not supported; dtune offloads parameter shards to the cpu (or none)"));
    if (c.offload_param_device == "cpu" && c.zero_stage != 3)
        throw UsageError(str(path, ": deepspeed_config.offload_param_device: cpu needs deepspeed_config.",
                             "zero_stage: 3 (parameters are offloaded only when they are sharded); set ",
                             "zero_stage to 3, or offload_param_device to none"));
    return c;
}

namespace {

int flag_int(const std::string& flag, const std::string& value, int min_value, int max_value) {
    auto v = to_long(value);
    if (!v || *v < min_value || *v > max_value)
        throw UsageError(str(flag, " '", value, "' is not an integer in [", min_value, ", ", max_value, "]"));
    return static_cast<int>(*v);
}

}  // namespace

LaunchOptions parse_launch_args(const std::vector<std::string>& args) {
    LaunchOptions o;
    std::size_t i = 0;
    for (; i < args.size(); ++i) {
        std::string flag = args[i];
        if (flag == "--") {
            o.command.assign(args.begin() + static_cast<long>(i) + 1, args.end());
            break;
        }
        std::string value;
        if (auto eq = flag.find('='); eq != std::string::npos && flag.rfind("--", 0) == 0) {
            value = flag.substr(eq + 1);
            flag = flag.substr(0, eq);
        } else {
            if (flag.rfind("--", 0) != 0)
                throw UsageError(str("unexpected argument '", flag,
                                     "'; put the command to run after `--`, e.g. ",
                                     "`dtune launch --nproc_per_node 2 -- train --config config.json`"));
            if (i + 1 >= args.size()) throw UsageError(str(flag, " needs a value"));
            value = args[++i];
        }
        if (flag == "--nproc_per_node" || flag == "--nproc-per-node")
            o.nproc_per_node = flag_int(flag, value, 1, 1024);
        else if (flag == "--nnodes")
            o.nnodes = flag_int(flag, value, 1, 65536);
        else if (flag == "--node_rank" || flag == "--node-rank" || flag == "--machine_rank")
            o.node_rank = flag_int(flag, value, 0, 65535);
        else if (flag == "--master_addr" || flag == "--master-addr" || flag == "--main_process_ip")
            o.master_addr = value;
        else if (flag == "--master_port" || flag == "--master-port" || flag == "--main_process_port")
            o.master_port = flag_int(flag, value, 1, 65535);
        else if (flag == "--accelerate_config" || flag == "--config_file")
            o.accelerate_config = value;
        else if (flag == "--grace_period")
            o.grace_period_s = flag_int(flag, value, 0, 3600);
        else
            throw UsageError(
                str("unknown option '", flag, "' for `dtune launch`; see `dtune launch --help`"));
    }
    return o;
}

LaunchConfig resolve_launch_config(const LaunchOptions& o, const std::optional<AccelerateConfig>& acc,
                                   int default_nproc) {
    LaunchConfig c;
    const std::string src = o.accelerate_config ? str("accelerate config ", *o.accelerate_config) : "";
    c.nnodes = o.nnodes.value_or(acc && acc->num_machines ? *acc->num_machines : 1);
    if (c.nnodes < 1) throw UsageError(str(src, ": num_machines must be at least 1"));
    if (o.nproc_per_node) {
        c.nproc_per_node = *o.nproc_per_node;
    } else if (acc && acc->num_processes) {
        int total = *acc->num_processes;
        if (total < c.nnodes || total % c.nnodes != 0)
            throw UsageError(
                str(src, ": num_processes=", total, " (the total over all machines) is not a multiple ",
                    "of num_machines=", c.nnodes, "; every node must run the same number of processes: ",
                    "set num_processes = GPUs per node x num_machines (e.g. 32 for 4 nodes x 8 GPUs)"));
        c.nproc_per_node = total / c.nnodes;
    } else {
        c.nproc_per_node = default_nproc < 1 ? 1 : default_nproc;
    }
    if (o.nproc_per_node && acc && acc->num_processes && *acc->num_processes != c.world_size())
        throw UsageError(str("--nproc_per_node ", c.nproc_per_node, " x ", c.nnodes,
                             " node(s) = ", c.world_size(), " processes, but ", src, " says num_processes=",
                             *acc->num_processes, " (the total); make them agree or drop one of them"));
    c.node_rank = o.node_rank.value_or(acc && acc->machine_rank ? *acc->machine_rank : 0);
    if (c.node_rank >= c.nnodes)
        throw UsageError(str("node rank ", c.node_rank, " is not below the number of nodes ", c.nnodes,
                             "; give each node a distinct --node_rank (machine_rank) from 0 to ",
                             c.nnodes - 1));
    auto addr = o.master_addr ? o.master_addr : (acc ? acc->main_process_ip : std::nullopt);
    if (!addr && c.nnodes > 1)
        throw UsageError(str("a ", c.nnodes,
                             "-node launch needs --master_addr (main_process_ip): the address of ",
                             "node 0 that every node can reach"));
    c.master_addr = addr.value_or("127.0.0.1");
    c.master_port = o.master_port.value_or(acc && acc->main_process_port ? *acc->main_process_port : 29500);
    if (c.master_port < 1 || c.master_port > 65535)
        throw UsageError(str("master port ", c.master_port, " is not a TCP port (1-65535)"));
    c.grace_period_s = o.grace_period_s;
    c.command = o.command;
    if (c.command.empty())
        throw UsageError(
            "no command to launch; add `-- <dtune subcommand> [args]`, e.g. `-- train --config c.json`");
    if (acc) {
        if (acc->mixed_precision) c.extra_env["DTUNE_MIXED_PRECISION"] = *acc->mixed_precision;
        if (acc->zero_stage) c.extra_env["DTUNE_ZERO_STAGE"] = std::to_string(*acc->zero_stage);
        if (acc->offload_optimizer_device)
            c.extra_env["DTUNE_OFFLOAD_OPTIMIZER_DEVICE"] = *acc->offload_optimizer_device;
        if (acc->offload_param_device) c.extra_env["DTUNE_OFFLOAD_PARAM_DEVICE"] = *acc->offload_param_device;
        if (acc->gradient_accumulation_steps)
            c.extra_env["DTUNE_GRADIENT_ACCUMULATION_STEPS"] =
                std::to_string(*acc->gradient_accumulation_steps);
        if (acc->gradient_clipping) c.extra_env["DTUNE_GRADIENT_CLIPPING"] = str(*acc->gradient_clipping);
    }
    return c;
}

}  // namespace dtune::dist
