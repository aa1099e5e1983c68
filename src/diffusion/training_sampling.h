// What a training step draws at random: the noise (with SimpleTuner's offset noise and input
// perturbation), the DDPM timesteps (uniform, SimpleTuner's timestep bias, segmented across the batch)
// and, for flow-matching models, the sigmas (logit-normal, uniform, Beta or Flux's fast list, with
// SD3/Flux's shift) and the embedded guidance of guidance-distilled networks (Flux [dev]).
// Invariant: every random number comes from the at::Generator the caller passes, drawn on that
// generator's device (then moved), so a run is reproducible from its seed and resumable from the
// generator's state, and a CPU generator gives the same draws whatever device trains. Timesteps and
// sigmas come back on the CPU. The *_on variants are the exception: they draw on the given device
// with its default generator and never touch the host (CUDA graphs, train::StepOptions::device_rng).
// draw_training_noise serves both: one formulation with no host read, from a generator or from a
// device's default one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
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

// One timestep per batch element, each from its own segment of [0, T) (first element from the
// highest segment), drawn by the segment's weights: SimpleTuner's segmented_timestep_selection. As
// there, consecutive segments share their boundary timestep and the weights are normalised in place
// segment by segment, so a shared boundary is drawn almost only by the higher segment. [B] int64.
at::Tensor segmented_timesteps(const at::Tensor& weights, int64_t batch_size, at::Generator& generator);

struct TimestepSamplingOptions {
    TimestepBiasOptions bias;
    bool disable_segmented_timestep_sampling = false;
};

// SimpleTuner's choice per step: segmented when B > 1 (unless disabled), else multinomial with
// replacement over the weights. [B] int64 on the CPU.
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

// [B] float32 sigmas on the CPU: the schedule's draw (flow_sigma_schedule), then the shift
// (flow_shift_for). Logit-normal and uniform draw torch.randn / torch.rand from `generator`; Beta
// draws torch.distributions.Beta's Dirichlet sample; the fast list one index in [0, 10) per sample.
// Nothing is clamped (SimpleTuner does not clamp either): the fast list gives sigma 1 (pure noise).
at::Tensor sample_flow_sigmas(int64_t batch_size, const FlowMatchingOptions& options,
                              at::IntArrayRef latent_shape, at::Generator& generator);
// Whether sample_flow_sigmas_on can draw the schedule: logit-normal and uniform are one device op
// each; Beta's gamma draws and the fast list's table lookup stay on the host path.
bool flow_sigmas_drawable_on_device(const FlowMatchingOptions& options);
// sample_flow_sigmas on `device` with its default generator ([B] float32 there): the same
// distributions (one randn or rand of [B]) and the same shift, which flow_shift_for computes on the
// host from the latent shape (fixed per captured batch shape), so a CUDA graph can capture it.
// UsageError for Beta or the fast list (flow_sigmas_drawable_on_device).
at::Tensor sample_flow_sigmas_on(const at::Device& device, int64_t batch_size,
                                 const FlowMatchingOptions& options, at::IntArrayRef latent_shape);
// (1 - sigma) x0 + sigma noise, sigma [B] broadcast over the rest.
at::Tensor flow_noisy_latents(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& sigmas);
// Timesteps the transformer sees: sigma * 1000.
inline at::Tensor flow_timesteps(const at::Tensor& sigmas) {
    return sigmas * 1000.0;
}

}  // namespace dtune::diffusion
