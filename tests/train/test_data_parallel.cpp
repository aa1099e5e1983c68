// Data-parallel pieces that need no second process: rank r of N serves and draws exactly rows
// [r*B, (r+1)*B) of what one process with batch N*B serves and draws (synthetic source, caption
// dropout); ZeRO stage resolution; the ZeRO-2 partition and bucket layout (hand-worked cases); the
// single-process DataParallel (no sockets, agreement is local).
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/error.h"
#include "dist/env.h"
#include "dist/group.h"
#include "dist/reducer.h"
#include "dist/zero3.h"
#include "family/sdxl/sdxl_family.h"
#include "train/batch_source.h"
#include "train/config.h"
#include "train/data_parallel.h"
#include "train/step.h"

namespace dtune::train {
namespace test_data_parallel_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

SyntheticBatchOptions synthetic(int64_t batch, int rank, int world) {
    SyntheticBatchOptions o;
    o.batch_size = batch;
    o.latent_size = 4;
    o.tokens = 3;
    o.dim = 5;
    o.pooled_dim = 2;
    o.rank = rank;
    o.world_size = world;
    return o;
}

TEST(DataParallelSharding, SyntheticRanksServeRowsOfTheGlobalBatch) {
    SyntheticBatchSource whole(synthetic(4, 0, 1));
    auto g = at::detail::createCPUGenerator(5);
    std::vector<TrainBatch> global{whole.next(g), whole.next(g)};
    for (int rank = 0; rank < 2; ++rank) {
        SyntheticBatchSource part(synthetic(2, rank, 2));
        auto gr = at::detail::createCPUGenerator(5);  // every rank holds the same generator state
        for (const auto& expected : global) {
            TrainBatch b = part.next(gr);
            ASSERT_EQ(b.latents.size(0), 2);
            EXPECT_TRUE(at::equal(b.latents, expected.latents.slice(0, 2 * rank, 2 * rank + 2)));
            EXPECT_TRUE(at::equal(b.cond.at("prompt_embeds"),
                                  expected.cond.at("prompt_embeds").slice(0, 2 * rank, 2 * rank + 2)));
            EXPECT_TRUE(at::equal(b.cond.at("pooled_prompt_embeds"),
                                  expected.cond.at("pooled_prompt_embeds").slice(0, 2 * rank, 2 * rank + 2)));
            EXPECT_EQ(b.paths[0], expected.paths[static_cast<size_t>(2 * rank)]);
        }
        // Same stream afterwards: the rank advanced its generator exactly as the single process did.
        EXPECT_TRUE(at::equal(gr.get_state(), g.get_state()));
    }
}

TEST(DataParallelSharding, CaptionDropoutDrawsForTheGlobalBatch) {
    PromptEmbedding empty{{"prompt_embeds", at::full({3, 5}, 7.0f)},
                          {"pooled_prompt_embeds", at::zeros({2})}};
    auto dropped_rows = [&](int rank, int world, int64_t batch) {
        SyntheticBatchSource s(synthetic(batch, 0, 1));
        auto g = at::detail::createCPUGenerator(9);
        TrainBatch b = s.next(g);
        auto dg = at::detail::createCPUGenerator(21);
        apply_caption_dropout(family::sdxl_family(), b, empty, 0.5, dg, rank, world);
        std::vector<bool> rows;
        for (int64_t i = 0; i < batch; ++i)
            rows.push_back(b.cond.at("prompt_embeds")[i].eq(7.0f).all().item<bool>());
        return rows;
    };
    const auto whole = dropped_rows(0, 1, 8);
    EXPECT_GT(std::count(whole.begin(), whole.end(), true), 0);  // p = 0.5 over 8 rows
    EXPECT_LT(std::count(whole.begin(), whole.end(), true), 8);
    for (int rank = 0; rank < 4; ++rank) {
        const auto mine = dropped_rows(rank, 4, 2);
        EXPECT_EQ(mine[0], whole[static_cast<size_t>(2 * rank)]) << "rank " << rank;
        EXPECT_EQ(mine[1], whole[static_cast<size_t>(2 * rank + 1)]) << "rank " << rank;
    }
}

TEST(DataParallelConfig, ZeroStageFromConfigOrLauncher) {
    TrainConfig c;
    ::unsetenv("DTUNE_ZERO_STAGE");
    EXPECT_EQ(resolve_zero_stage(c), 0);
    ::setenv("DTUNE_ZERO_STAGE", "1", 1);
    EXPECT_EQ(resolve_zero_stage(c), 1);
    ::setenv("DTUNE_ZERO_STAGE", "2", 1);
    EXPECT_EQ(resolve_zero_stage(c), 2);
    ::setenv("DTUNE_ZERO_STAGE", "one", 1);
    EXPECT_THROW(resolve_zero_stage(c), UsageError);
    c.set("zero_stage", "0", "test");  // the config wins over the launcher's variable
    EXPECT_EQ(resolve_zero_stage(c), 0);
    EXPECT_THROW(c.set("zero_stage", "4", "test"), UsageError);  // refused as the config is read
    ::setenv("DTUNE_ZERO_STAGE", "4", 1);
    c.set("zero_stage", "null", "test");
    EXPECT_THROW(resolve_zero_stage(c), UsageError);  // and from the launcher's variable
    ::setenv("DTUNE_ZERO_STAGE", "3", 1);             // deepspeed_config.zero_stage 3
    EXPECT_EQ(resolve_zero_stage(c), 3);
    ::unsetenv("DTUNE_ZERO_STAGE");
}

// SimpleTuner's FSDP keys map onto ZeRO-3; a contradicting zero_stage and nvme parameter offload
// are refused naming the key.
TEST(DataParallelConfig, FsdpKeysMapOntoZeroStage3) {
    ::unsetenv("DTUNE_ZERO_STAGE");
    ::unsetenv("DTUNE_OFFLOAD_PARAM_DEVICE");
    TrainConfig c;
    c.set("fsdp_enable", "true", "test");
    EXPECT_EQ(resolve_zero_stage(c), 3);
    EXPECT_TRUE(resolve_zero3_options(c).reshard_after_forward);
    c.set("fsdp_reshard_after_forward", "false", "test");
    EXPECT_FALSE(resolve_zero3_options(c).reshard_after_forward);
    c.set("zero_stage", "2", "test");
    try {
        resolve_zero_stage(c);
        FAIL() << "fsdp_enable with zero_stage 2 accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("fsdp_enable is true"), std::string::npos) << e.what();
    }
    // Parameter offload to the host is the ZeRO-3 engine's; nvme is not implemented.
    c.set("offload_param_device", "cpu", "test");
    EXPECT_TRUE(resolve_zero3_options(c).offload_params);
    {
        TrainConfig stage2;
        stage2.set("zero_stage", "2", "test");
        stage2.set("offload_param_device", "cpu", "test");
        try {
            resolve_zero_stage(stage2);
            FAIL() << "offload_param_device cpu with zero_stage 2 accepted";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find("parameters are offloaded only when they are sharded"),
                      std::string::npos)
                << e.what();
        }
    }
    ::setenv("DTUNE_ZERO3_PREFETCH", "yes", 1);
    try {
        resolve_zero3_options(c);
        ADD_FAILURE() << "DTUNE_ZERO3_PREFETCH=yes accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_ZERO3_PREFETCH is 'yes'"), std::string::npos) << e.what();
    }
    ::setenv("DTUNE_ZERO3_PREFETCH", "2", 1);
    EXPECT_EQ(resolve_zero3_options(c).prefetch, 2);
    ::unsetenv("DTUNE_ZERO3_PREFETCH");
    // The bound on blocks' full gradients waiting for their reduce-scatter (default 2, 0 = at the end).
    EXPECT_EQ(resolve_zero3_options(c).reduce_in_flight, 2);
    ::setenv("DTUNE_ZERO3_REDUCE_IN_FLIGHT", "0", 1);
    EXPECT_EQ(resolve_zero3_options(c).reduce_in_flight, 0);
    ::setenv("DTUNE_ZERO3_REDUCE_IN_FLIGHT", "-1", 1);
    try {
        resolve_zero3_options(c);
        ADD_FAILURE() << "DTUNE_ZERO3_REDUCE_IN_FLIGHT=-1 accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_ZERO3_REDUCE_IN_FLIGHT is '-1'"), std::string::npos)
            << e.what();
    }
    ::unsetenv("DTUNE_ZERO3_REDUCE_IN_FLIGHT");
    // The gradient bucket size: MiB, else 100 for the direct all-reduce and DDP's 25 for flat buckets.
    EXPECT_EQ(gradient_bucket_bytes(GradientHandoff::kDirect), std::size_t{100} << 20);
    EXPECT_EQ(gradient_bucket_bytes(GradientHandoff::kCopyIn), std::size_t{25} << 20);
    EXPECT_EQ(gradient_bucket_bytes(GradientHandoff::kInPlace), std::size_t{25} << 20);
    ::setenv("DTUNE_BUCKET_MB", "50", 1);
    EXPECT_EQ(gradient_bucket_bytes(GradientHandoff::kDirect), std::size_t{50} << 20);
    EXPECT_EQ(gradient_bucket_bytes(GradientHandoff::kCopyIn), std::size_t{50} << 20);
    ::setenv("DTUNE_BUCKET_MB", "big", 1);
    try {
        gradient_bucket_bytes(GradientHandoff::kDirect);
        ADD_FAILURE() << "DTUNE_BUCKET_MB=big accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_BUCKET_MB is 'big'"), std::string::npos) << e.what();
    }
    ::unsetenv("DTUNE_BUCKET_MB");
    // ZeRO-2's staging slots: 4, else DTUNE_ZERO2_SLOTS in [1, 64].
    EXPECT_EQ(zero2_staging_slots(), 4u);
    ::setenv("DTUNE_ZERO2_SLOTS", "2", 1);
    EXPECT_EQ(zero2_staging_slots(), 2u);
    for (const char* bad : {"0", "65", "2x", "-1"}) {
        ::setenv("DTUNE_ZERO2_SLOTS", bad, 1);
        try {
            zero2_staging_slots();
            ADD_FAILURE() << "DTUNE_ZERO2_SLOTS=" << bad << " accepted";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find(std::string("DTUNE_ZERO2_SLOTS is '") + bad + "'"),
                      std::string::npos)
                << e.what();
        }
    }
    ::unsetenv("DTUNE_ZERO2_SLOTS");
    // ZeRO-1/2 parameters reach the other ranks during the next forward unless DTUNE_ZERO_SYNC=step,
    // coalesced per block and owner unless forward-params.
    EXPECT_EQ(zero_sync_requested(), ZeroSync::kForward);
    ::setenv("DTUNE_ZERO_SYNC", "step", 1);
    EXPECT_EQ(zero_sync_requested(), ZeroSync::kStep);
    ::setenv("DTUNE_ZERO_SYNC", "forward", 1);
    EXPECT_EQ(zero_sync_requested(), ZeroSync::kForward);
    ::setenv("DTUNE_ZERO_SYNC", "forward-params", 1);
    EXPECT_EQ(zero_sync_requested(), ZeroSync::kForwardParams);
    ::setenv("DTUNE_ZERO_SYNC", "later", 1);
    try {
        zero_sync_requested();
        ADD_FAILURE() << "DTUNE_ZERO_SYNC=later accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_ZERO_SYNC is 'later'"), std::string::npos) << e.what();
    }
    ::unsetenv("DTUNE_ZERO_SYNC");
    // ZeRO-1 owns contiguous runs unless DTUNE_ZERO1_LAYOUT=greedy.
    EXPECT_FALSE(zero1_layout_greedy());
    ::setenv("DTUNE_ZERO1_LAYOUT", "greedy", 1);
    EXPECT_TRUE(zero1_layout_greedy());
    ::setenv("DTUNE_ZERO1_LAYOUT", "contiguous", 1);
    EXPECT_FALSE(zero1_layout_greedy());
    ::setenv("DTUNE_ZERO1_LAYOUT", "random", 1);
    try {
        zero1_layout_greedy();
        ADD_FAILURE() << "DTUNE_ZERO1_LAYOUT=random accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_ZERO1_LAYOUT is 'random'"), std::string::npos)
            << e.what();
    }
    ::unsetenv("DTUNE_ZERO1_LAYOUT");
    // Gradients all-reduced where backward left them unless DTUNE_DDP_GRAD_COPY=1 (copied into the
    // buckets) or 0 (the in-place adds); only a set variable counts as named.
    EXPECT_EQ(gradient_handoff_requested(), GradientHandoff::kDirect);
    EXPECT_FALSE(gradient_handoff_named());
    ::setenv("DTUNE_DDP_GRAD_COPY", "1", 1);
    EXPECT_EQ(gradient_handoff_requested(), GradientHandoff::kCopyIn);
    EXPECT_TRUE(gradient_handoff_named());
    ::setenv("DTUNE_DDP_GRAD_COPY", "0", 1);
    EXPECT_EQ(gradient_handoff_requested(), GradientHandoff::kInPlace);
    ::setenv("DTUNE_DDP_GRAD_COPY", "direct", 1);
    EXPECT_EQ(gradient_handoff_requested(), GradientHandoff::kDirect);
    ::setenv("DTUNE_DDP_GRAD_COPY", "yes", 1);
    try {
        gradient_handoff_requested();
        ADD_FAILURE() << "DTUNE_DDP_GRAD_COPY=yes accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_DDP_GRAD_COPY is 'yes'"), std::string::npos) << e.what();
    }
    ::unsetenv("DTUNE_DDP_GRAD_COPY");
    c.set("offload_param_device", "nvme", "test");
    try {
        resolve_zero3_options(c);
        FAIL() << "nvme parameter offload accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("offload_param_device in the config is 'nvme'"),
                  std::string::npos)
            << e.what();
    }
}

// The UsageError message `f` throws, or "" when it does not throw.
template <typename F>
std::string usage_error(F&& f) {
    try {
        f();
    } catch (const UsageError& e) {
        return e.what();
    }
    return "";
}

// SimpleTuner's fsdp_cpu_offload: the ZeRO-3 parameter shards and the optimizer in host memory, as
// offload_param_device cpu plus offload_optimizer_device cpu; an explicit other device for either,
// or no sharded parameters to offload, is refused naming both keys.
TEST(DataParallelConfig, FsdpCpuOffloadIsParameterAndOptimizerOffload) {
    ::unsetenv("DTUNE_ZERO_STAGE");
    ::unsetenv("DTUNE_OFFLOAD_PARAM_DEVICE");
    ::unsetenv("DTUNE_OFFLOAD_OPTIMIZER_DEVICE");
    // SimpleTuner's FSDP with the key at `offload` and the given other keys.
    auto fsdp = [](const char* offload, const std::vector<std::pair<const char*, const char*>>& more = {}) {
        TrainConfig c;
        c.set("fsdp_enable", "true", "test");
        c.set("fsdp_cpu_offload", offload, "test");
        for (const auto& [k, v] : more) c.set(k, v, "test");
        return c;
    };
    EXPECT_FALSE(resolve_zero3_options(fsdp("false")).offload_params);  // off by default
    EXPECT_FALSE(resolve_offload_optimizer(fsdp("false")));
    EXPECT_EQ(resolve_zero_stage(fsdp("true")), 3);
    EXPECT_TRUE(resolve_zero3_options(fsdp("true")).offload_params);
    EXPECT_TRUE(resolve_offload_optimizer(fsdp("true")));
    // Saying cpu explicitly as well agrees with it.
    const TrainConfig both =
        fsdp("true", {{"offload_param_device", "cpu"}, {"offload_optimizer_device", "cpu"}});
    EXPECT_TRUE(resolve_zero3_options(both).offload_params);
    EXPECT_TRUE(resolve_offload_optimizer(both));
    // An explicit none contradicts it: refused, naming both keys.
    std::string m = usage_error([&] {
        resolve_zero3_options(fsdp("true", {{"offload_param_device", "none"}}));
    });
    EXPECT_NE(m.find("fsdp_cpu_offload is true"), std::string::npos) << m;
    EXPECT_NE(m.find("offload_param_device in the config is 'none'"), std::string::npos) << m;
    m = usage_error([&] { resolve_offload_optimizer(fsdp("true", {{"offload_optimizer_device", "none"}})); });
    EXPECT_NE(m.find("fsdp_cpu_offload is true"), std::string::npos) << m;
    EXPECT_NE(m.find("offload_optimizer_device in the config is 'none'"), std::string::npos) << m;
    // So does accelerate's deepspeed_config passed on by `dtune launch`.
    ::setenv("DTUNE_OFFLOAD_PARAM_DEVICE", "nvme", 1);
    m = usage_error([&] { resolve_zero3_options(fsdp("true")); });
    EXPECT_NE(m.find("DTUNE_OFFLOAD_PARAM_DEVICE (from deepspeed_config.offload_param_device) is 'nvme'"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("fsdp_cpu_offload is true"), std::string::npos) << m;
    ::unsetenv("DTUNE_OFFLOAD_PARAM_DEVICE");
    ::setenv("DTUNE_OFFLOAD_OPTIMIZER_DEVICE", "none", 1);
    m = usage_error([&] { resolve_offload_optimizer(fsdp("true")); });
    EXPECT_NE(m.find("DTUNE_OFFLOAD_OPTIMIZER_DEVICE (from deepspeed_config.offload_optimizer_device) is "
                     "'none'"),
              std::string::npos)
        << m;
    ::unsetenv("DTUNE_OFFLOAD_OPTIMIZER_DEVICE");
    // Without sharded parameters there is nothing for it to offload.
    TrainConfig unsharded;
    unsharded.set("fsdp_cpu_offload", "true", "test");
    m = usage_error([&] { resolve_zero_stage(unsharded); });
    EXPECT_NE(m.find("fsdp_cpu_offload is true (FSDP's sharded parameters in host memory) but FSDP is off"),
              std::string::npos)
        << m;
    unsharded.set("zero_stage", "2", "test");
    m = usage_error([&] { resolve_zero_stage(unsharded); });
    EXPECT_NE(m.find("fsdp_cpu_offload is true"), std::string::npos) << m;
    EXPECT_NE(m.find("zero_stage in the config is 2"), std::string::npos) << m;
    unsharded.set("zero_stage", "3", "test");  // dtune's own key for the same engine
    EXPECT_EQ(resolve_zero_stage(unsharded), 3);
    EXPECT_TRUE(resolve_zero3_options(unsharded).offload_params);
    EXPECT_TRUE(resolve_offload_optimizer(unsharded));
}

std::vector<at::Tensor> tensors_of_sizes(const std::vector<long>& sizes) {
    std::vector<at::Tensor> out;
    for (long n : sizes) out.push_back(at::zeros({n}));
    return out;
}

std::vector<int> contiguous_owners(const std::vector<long>& sizes, int world) {
    return dist::ZeroPartition(tensors_of_sizes(sizes), world, dist::ZeroLayout::kContiguous).owners();
}

// Worked by hand: rank r takes the parameters whose element midpoint lies in its 1/world share.
TEST(ZeroPartitionContiguous, RunsBalancedByElementsAndNoRankEmpty) {
    EXPECT_EQ(contiguous_owners({4, 4, 4, 4}, 2), (std::vector<int>{0, 0, 1, 1}));  // midpoints 2 6 | 10 14
    EXPECT_EQ(contiguous_owners({1, 100, 1}, 2), (std::vector<int>{0, 0, 1}));      // 51 is not past 51
    EXPECT_EQ(contiguous_owners({100, 1}, 2), (std::vector<int>{0, 1}));            // rank 1 must get one
    EXPECT_EQ(contiguous_owners({1, 1, 1, 1}, 4), (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(contiguous_owners({3, 1, 1, 1, 1, 1}, 2), (std::vector<int>{0, 0, 1, 1, 1, 1}));
    EXPECT_EQ(contiguous_owners({5, 5}, 1), (std::vector<int>{0, 0}));
    // Fewer parameters than ranks: the last ranks own nothing, nobody is out of range.
    EXPECT_EQ(contiguous_owners({5, 5}, 3), (std::vector<int>{0, 1}));
}

// ZeRO-2 buckets (reverse order) close where the owner changes, so each is reduced to one rank.
TEST(ZeroPartitionContiguous, ReducerBucketsHaveOneOwner) {
    auto group = dist::init_group(dist::DistEnv{});  // one process: no sockets
    dist::ReducerOptions options;
    options.bucket_bytes = 1 << 20;
    options.owners = {0, 0, 1, 1, 1};
    dist::GradReducer sharded(*group, tensors_of_sizes({2, 2, 2, 2, 2}), options);
    using Buckets = std::vector<std::vector<std::size_t>>;
    EXPECT_EQ(sharded.buckets(), (Buckets{{4, 3, 2}, {1, 0}}));
    options.owners.clear();
    dist::GradReducer whole(*group, tensors_of_sizes({2, 2, 2, 2, 2}), options);
    EXPECT_EQ(whole.buckets(), (Buckets{{4, 3, 2, 1, 0}}));
    options.owners = {0, 1};
    EXPECT_THROW(dist::GradReducer(*group, tensors_of_sizes({2, 2, 2}), options), Error);
}

TEST(DataParallelSingle, OneProcessAgreesLocallyAndPicksTheLocalGpu) {
    dist::DistEnv env;  // not launched: one process, no sockets
    DataParallel dp(env, c10::Device(c10::kCPU), 1, std::chrono::seconds(5));
    EXPECT_EQ(dp.world_size(), 1);
    EXPECT_EQ(dp.zero_stage(), 0);  // nothing to shard with one rank
    auto p = at::ones({3}).set_requires_grad(true);
    dp.attach({p});
    EXPECT_TRUE(dp.updates(0));
    StepAgreement a = dp.agree(0.25, false, 0);
    EXPECT_EQ(a.mean_loss, 0.25);
    EXPECT_FALSE(a.stop || a.fault());
    a = dp.agree(0.5, true, 3);  // GPU 2 of this node faulted (index + 1)
    EXPECT_TRUE(a.stop);
    EXPECT_EQ(a.fault_rank, 0);
    EXPECT_EQ(a.fault_gpu, 2);

    dist::DistEnv launched;
    launched.launched = true;
    launched.world_size = launched.local_world_size = 4;
    launched.rank = launched.local_rank = 3;
}

// The 2-GPU NCCL hang of session 2: "cuda" parsed to cuda:0 on every rank, so both ranks shared GPU 0.
TEST(DataParallel, LaunchedRanksTakeTheirOwnGpu) {
    dist::DistEnv launched;
    launched.launched = true;
    launched.world_size = launched.local_world_size = 4;
    launched.rank = launched.local_rank = 3;
    const c10::Device gpu3(c10::kCUDA, 3);
    EXPECT_EQ(DataParallel::pick_device("cuda", launched, 4), gpu3);
    EXPECT_EQ(DataParallel::pick_device("CUDA", launched, 8), gpu3);
    EXPECT_EQ(DataParallel::pick_device("auto", launched, 4), gpu3);
    // One visible GPU per process (CUDA_VISIBLE_DEVICES set per rank by the launcher).
    EXPECT_EQ(DataParallel::pick_device("cuda", launched, 1), c10::Device(c10::kCUDA, 0));
    EXPECT_EQ(DataParallel::pick_device("cpu", launched, 4), c10::Device(c10::kCPU));
    EXPECT_EQ(DataParallel::pick_device("auto", launched, 0), c10::Device(c10::kCPU));
    auto error_of = [&](const std::string& text, int gpus) -> std::string {
        try {
            DataParallel::pick_device(text, launched, gpus);
        } catch (const UsageError& e) {
            return e.what();
        }
        return "(no error)";
    };
    EXPECT_NE(error_of("cuda", 2).find("--nproc_per_node 2"), std::string::npos) << error_of("cuda", 2);
    EXPECT_NE(error_of("cuda", 0).find("use --device cpu"), std::string::npos) << error_of("cuda", 0);
    dist::DistEnv single;
    EXPECT_EQ(DataParallel::pick_device("cpu", single, 0), c10::Device(c10::kCPU));
}

}  // namespace
}  // namespace test_data_parallel_local
}  // namespace dtune::train
