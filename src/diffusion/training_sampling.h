// What a training step draws at random: the noise (with SimpleTuner's offset noise and input
// perturbation), the DDPM timesteps (uniform, SimpleTuner's timestep bias, segmented across the batch)
// and, for flow-matching models, the sigmas (logit-normal, uniform, Beta or Flux's fast list, with
// SD3/Flux's shift) and the embedded guidance of guidance-distilled networks (Flux [dev]).
// Invariant: every random number comes from the at::Generator the caller passes, drawn on that
// generator's device (then moved), so a run is reproducible from its seed and resumable from the
// generator's state, and a CPU generator gives the same draws whatever device trains. Timesteps and
// sigmas come back on the CPU. The *_on variants are the exception: they draw on the given device
// with its default generator and never touch the host (CUDA graphs, train::StepOptions::device_rng).
// draw_training_noise, draw_timesteps and draw_flow_sigmas serve both: one formulation with no host
// read, from a generator or from a device's default one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace dtune::diffusion {

// ---- noise -------------------------------------------------------------------------------------

// SimpleTuner's option names and defaults (SIMPLETUNER.md §6): the offset applies only with
// offset_noise=true, then with probability noise_offset_probability.
struct NoiseOptions {
    bool offset_noise = false;
    double noise_offset = 0.1;
    double noise_offset_probability = 0.25;
    double input_perturbation = 0.0;
    // 0: constant; else decays linearly to 0 at this step. The config accepts only 0 (SimpleTuner's
    // default), so the strength a CUDA graph bakes in at capture never changes.
    int64_t input_perturbation_steps = 0;
};

struct TrainingNoise {
    at::Tensor noise;        // [B, C, H, W]: what the target is built from
    at::Tensor input_noise;  // [B, C, H, W]: what is added to the latents (noise + perturbation)
};

// Copies a host tensor to `device` without waiting for the device: through pinned memory with a
// non-blocking copy when the device is a GPU (a plain .to() of pageable memory synchronises the
// stream, which drains the GPU's queue once per step), a plain .to() otherwise.
at::Tensor to_device_async(const at::Tensor& host, const at::Device& device);

// The input perturbation's strength at `global_step`: input_perturbation, decayed linearly to 0 at
// input_perturbation_steps when that is > 0 (0 from then on).
double input_perturbation_scale(const NoiseOptions& options, int64_t global_step);

// The noise of a training step for a batch of `shape` [B, C, ...], float32. Draws, in this order
// and for every step alike (the count depends on the options only, never on a draw or the step, so
// a CUDA graph replays the same kernels and a resumed run continues the same stream):
//   1. noise ~ N(0, 1) of `shape`;
//   2. offset noise (offset_noise, never for flow matching, as in SimpleTuner): one U(0, 1) draw per
//      batch, unless noise_offset_probability >= 1, then noise_offset * N(0, 1) of [B, C, 1, 1],
//      added when the uniform draw is below the probability (a 0/1 mask: nothing is read back);
//   3. input perturbation (input_perturbation != 0): input_noise = noise + scale * N(0, 1) of
//      `shape` (input_perturbation_scale; after a decay ends the draw is still made, times 0).
// With `generator` the numbers come from it, on its device; without, from `device`'s default
// generator on `device` (CUDA graphs: no host work at all). The result stays where it was drawn.
TrainingNoise draw_training_noise(at::IntArrayRef shape, const NoiseOptions& options, int64_t global_step,
                                  const std::optional<at::Generator>& generator, const at::Device& device,
                                  bool flow_matching = false);

// draw_training_noise for a batch shaped like `latents` from `generator`, moved to the latents' device.
TrainingNoise sample_training_noise(const at::Tensor& latents, const NoiseOptions& options,
                                    int64_t global_step, at::Generator& generator,
                                    bool flow_matching = false);

// ---- DDPM timesteps ----------------------------------------------------------------------------

enum class TimestepBiasStrategy { kNone, kEarlier, kLater, kRange };
TimestepBiasStrategy parse_timestep_bias_strategy(const std::string& name);

// SimpleTuner's timestep_bias_* options and their defaults (its field registry).
struct TimestepBiasOptions {
    TimestepBiasStrategy strategy = TimestepBiasStrategy::kNone;
    double multiplier = 1.0;
    int64_t begin = 0;      // range strategy: first biased timestep
    int64_t end = 1000;     // range strategy: one past the last biased timestep
    double portion = 0.25;  // earlier/later: the fraction of timesteps biased
};

// [T] float32 sampling weights: ones for kNone, else the biased entries multiplied by `multiplier`
// and the whole normalised to sum 1 (SimpleTuner's generate_timestep_weights). Throws UsageError for
// a multiplier <= 0 or a range outside [0, T].
at::Tensor timestep_weights(const TimestepBiasOptions& options, int64_t num_train_timesteps);

struct TimestepSamplingOptions {
    TimestepBiasOptions bias;
    bool disable_segmented_timestep_sampling = false;
};

// The inverse CDF of the timestep draw for a batch of `batch_size`, float64 on the CPU. SimpleTuner's
// choice per step: segmented when B > 1 (unless disabled), else multinomial with replacement over
// timestep_weights. Segmented ([B, T]): row i is the cumulative weight of sample i's own segment of
// [0, T) (the first sample's is the highest), 0 below it and exactly 1 from its top timestep on,
// with SimpleTuner's segmented_timestep_selection quirks kept: consecutive segments share their
// boundary timestep and the weights are normalised in place segment by segment, so a shared boundary
// enters the lower segment already divided by the higher segment's sum. Otherwise [T], the
// cumulative weights. Timestep k is drawn for u ~ U[0, 1) with cdf[k - 1] <= u < cdf[k].
at::Tensor timestep_cdf(int64_t batch_size, int64_t num_train_timesteps,
                        const TimestepSamplingOptions& options);

// [B] int64 timesteps from a timestep_cdf table by inverse CDF: one float64 U[0, 1) per sample from
// `generator` (on its device, where `cdf` must be), or without one from the default generator of
// `cdf`'s device, then the count of table entries <= u. No host read, so a CUDA graph captures it.
at::Tensor timesteps_from_cdf(const at::Tensor& cdf, int64_t batch_size,
                              const std::optional<at::Generator>& generator);

// timestep_cdf tables kept on their device, one per batch size, options and device, so a step does
// not rebuild its table. For the draws without a generator (CUDA graphs) it is required: a table
// copied from the host inside a capture would break it, and the first steps of every batch shape run
// eagerly before it is captured (GraphedStep's warm-up), which fills the cache. Thread-safe; shared
// by copies of the train::StepOptions that own it.
class TimestepCdfCache {
  public:
    at::Tensor get(int64_t batch_size, int64_t num_train_timesteps, const TimestepSamplingOptions& options,
                   const at::Device& device);

  private:
    std::mutex mutex_;
    std::map<std::string, at::Tensor> tables_;  // key: the arguments as text
};

// The timesteps of a training step, [B] int64 where drawn. With `generator`: by inverse CDF
// (timestep_cdf, timesteps_from_cdf, the table from `cache` when given) on the generator's device.
// Without: on `device` with its default
// generator and no host work: the same inverse CDF with a timestep bias (the table from `cache` when
// given), and one at::randint over [0, T) without one (not segmented: the uniform draw graphed runs
// have always made, whose marginal is the segmented draw's).
at::Tensor draw_timesteps(int64_t batch_size, int64_t num_train_timesteps,
                          const TimestepSamplingOptions& options,
                          const std::optional<at::Generator>& generator, const at::Device& device,
                          TimestepCdfCache* cache = nullptr);

// draw_timesteps from `generator`: [B] int64 on the CPU.
at::Tensor sample_timesteps(int64_t batch_size, int64_t num_train_timesteps,
                            const TimestepSamplingOptions& options, at::Generator& generator);

// ---- flow matching (SD3 / Flux) -----------------------------------------------------------------

// The guidance scale a guidance-distilled network (Flux [dev]) is given during training, per sample:
// SimpleTuner's flux_guidance_mode "constant" (flux_guidance_value) or "random-range" (uniform in
// [flux_guidance_min, flux_guidance_max], Python's random.uniform: min + (max - min) * U).
struct EmbeddedGuidanceOptions {
    enum class Mode { kConstant, kRandomRange };
    Mode mode = Mode::kConstant;
    double value = 1.0;  // flux_guidance_value
    double min = 0.0;    // flux_guidance_min
    double max = 4.0;    // flux_guidance_max
};
// "constant" / "random-range"; UsageError naming flux_guidance_mode and the choices otherwise.
EmbeddedGuidanceOptions::Mode parse_embedded_guidance_mode(const std::string& name);
// [B] float32 on the CPU (the random range drawn in float64 from `generator`, as Python draws it).
at::Tensor sample_embedded_guidance(int64_t batch_size, const EmbeddedGuidanceOptions& options,
                                    at::Generator& generator);
// The same on `device` with its default generator (one float64 uniform per sample for the random
// range, nothing for a constant): no host work, so a CUDA graph can capture it. [B] float32 there.
at::Tensor sample_embedded_guidance_on(const at::Device& device, int64_t batch_size,
                                       const EmbeddedGuidanceOptions& options);

// Where the unshifted sigmas come from. SimpleTuner's order when several are switched on: uniform,
// then Beta, then the fast list; logit-normal only when none is.
enum class FlowSigmaSchedule { kLogitNormal, kUniform, kBeta, kFluxFast };

struct FlowMatchingOptions {
    double sigmoid_scale = 1.0;         // flow_sigmoid_scale (logit-normal: sigmoid(scale * N(0, 1)))
    std::optional<double> shift = 3.0;  // flow_schedule_shift (> 0 to apply)
    // flow_schedule_auto_shift: the shift from the image size. It wins over a static shift (SimpleTuner
    // sets flow_schedule_shift to 0 when both are given).
    bool auto_shift = false;
    bool uniform = false;             // flow_use_uniform_schedule: U(0, 1)
    bool beta = false;                // flow_use_beta_schedule: Beta(beta_alpha, beta_beta)
    double beta_alpha = 2.0;          // flow_beta_schedule_alpha
    double beta_beta = 2.0;           // flow_beta_schedule_beta
    bool flux_fast_schedule = false;  // sigma from {1 (7 of 10), 0.75, 0.5, 0.25}, never shifted
    // The auto shift's anchors: the model's scheduler_config.json (Flux's values by default);
    // SimpleTuner's patch size 2 (the scheduler config has none).
    int64_t base_image_seq_len = 256;
    int64_t max_image_seq_len = 4096;
    double base_shift = 0.5;
    double max_shift = 1.15;
    int64_t patch_size = 2;
    // Networks with an embedded guidance input (Flux [dev]): the step draws one scale per sample and
    // passes it as cond["guidance"] [B]. Unset: the network takes none.
    std::optional<EmbeddedGuidanceOptions> guidance;
};

FlowSigmaSchedule flow_sigma_schedule(const FlowMatchingOptions& options);

// sigma' = shift * sigma / (1 + (shift - 1) * sigma) (SD3 paper §5.3.2).
at::Tensor apply_flow_shift(const at::Tensor& sigmas, double shift);
// Flux's resolution-dependent shift exp(mu), mu linear in the token count between the two anchors
// (diffusers' calculate_shift).
double flux_auto_shift(int64_t image_seq_len, const FlowMatchingOptions& options);
// The shift sample_flow_sigmas applies for latents of `latent_shape` [B, C, H, W] (or [B, C, F, H,
// W]): the auto shift when on, else the static one when > 0; nullopt when none (and always for the
// fast list, which SimpleTuner never shifts).
std::optional<double> flow_shift_for(const FlowMatchingOptions& options, at::IntArrayRef latent_shape);

// The sigmas of a flow-matching step, [B] float32 where drawn: the schedule's draw
// (flow_sigma_schedule), then the shift (flow_shift_for, computed on the host from the latent shape,
// which is fixed per captured batch shape). Logit-normal and uniform draw one randn / rand of [B]; Beta
// torch.distributions.Beta's Dirichlet sample (at::_sample_dirichlet of concentration [a, b] per
// sample: its gamma draws take the generator's Philox offsets as other CUDA random ops do); the fast
// list one index in [0, 10) per sample, mapped to its sigma arithmetically (no table to copy). From
// `generator` on its device, or without one from `device`'s default generator with no host work, so
// a CUDA graph captures it. Nothing is clamped (SimpleTuner does not clamp either): the fast list gives
// sigma 1 (pure noise). UsageError for a Beta alpha or beta <= 0.
at::Tensor draw_flow_sigmas(int64_t batch_size, const FlowMatchingOptions& options,
                            at::IntArrayRef latent_shape, const std::optional<at::Generator>& generator,
                            const at::Device& device);
// draw_flow_sigmas from `generator`: [B] float32 on the CPU.
at::Tensor sample_flow_sigmas(int64_t batch_size, const FlowMatchingOptions& options,
                              at::IntArrayRef latent_shape, at::Generator& generator);
// draw_flow_sigmas on `device` with its default generator: [B] float32 there.
at::Tensor sample_flow_sigmas_on(const at::Device& device, int64_t batch_size,
                                 const FlowMatchingOptions& options, at::IntArrayRef latent_shape);
// (1 - sigma) x0 + sigma noise, sigma [B] broadcast over the rest.
at::Tensor flow_noisy_latents(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& sigmas);
// Timesteps the transformer sees: sigma * 1000.
inline at::Tensor flow_timesteps(const at::Tensor& sigmas) {
    return sigmas * 1000.0;
}

}  // namespace dtune::diffusion
