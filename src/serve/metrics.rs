//! `/metrics` in Prometheus' text format: requests by endpoint and status, prompt and
//! generated tokens, the engine's queue, sequences and KV blocks (set by the engine
//! thread after every step), prefix-cache hits, and histograms of the time to the first
//! token and per output token.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

use crate::engine::EngineStats;

/// Every metric the server keeps.
pub struct Metrics {
    registry: Registry,
    /// `graft_requests_total{endpoint, status}`.
    requests: IntCounterVec,
    /// `graft_prompt_tokens_total`.
    pub prompt_tokens: IntCounter,
    /// `graft_generation_tokens_total`, counted by the engine thread as tokens come.
    pub generation_tokens: IntCounter,
    /// `graft_requests_waiting`: requests the engine holds that wait for room.
    waiting: IntGauge,
    /// `graft_requests_running`: sequences being computed.
    running: IntGauge,
    /// `graft_kv_blocks_used` and `graft_kv_blocks_free`.
    blocks_used: IntGauge,
    blocks_free: IntGauge,
    /// `graft_prefix_cache_hit_tokens_total` / `graft_prefix_cache_lookup_tokens_total`.
    prefix_hits: IntCounter,
    prefix_lookups: IntCounter,
    /// `graft_preemptions_total`.
    preemptions: IntCounter,
    /// `graft_batch_plans_built_total`: batch graphs built (one per new shape, again
    /// after one of the kept plans was unloaded).
    plans_built: IntCounter,
    /// `graft_time_to_first_token_seconds`.
    pub ttft: Histogram,
    /// `graft_time_per_output_token_seconds`.
    pub tpot: Histogram,
    /// The engine's cumulative counters as last published.
    last: std::sync::Mutex<EngineStats>,
}

/// The endpoints counted by name; every other path counts as `other`.
const ENDPOINTS: [&str; 9] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/",
    "other",
];

impl Metrics {
    /// A registry with every metric at zero.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("a valid metric name");
            registry.register(Box::new(c.clone())).expect("a new name");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("a valid metric name");
            registry.register(Box::new(g.clone())).expect("a new name");
            g
        };
        let histogram = |name: &str, help: &str, buckets: Vec<f64>| {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                .expect("a valid histogram");
            registry.register(Box::new(h.clone())).expect("a new name");
            h
        };
        let requests = IntCounterVec::new(
            Opts::new("graft_requests_total", "HTTP requests answered"),
            &["endpoint", "status"],
        )
        .expect("a valid metric name");
        registry
            .register(Box::new(requests.clone()))
            .expect("a new name");
        Metrics {
            requests,
            prompt_tokens: counter(
                "graft_prompt_tokens_total",
                "Prompt tokens of finished requests",
            ),
            generation_tokens: counter(
                "graft_generation_tokens_total",
                "Tokens generated, also for requests cancelled before their end",
            ),
            waiting: gauge(
                "graft_requests_waiting",
                "Requests waiting for a sequence slot or KV blocks",
            ),
            running: gauge("graft_requests_running", "Sequences being computed"),
            blocks_used: gauge("graft_kv_blocks_used", "KV blocks held by sequences"),
            blocks_free: gauge("graft_kv_blocks_free", "KV blocks that can be handed out"),
            prefix_hits: counter(
                "graft_prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache",
            ),
            prefix_lookups: counter(
                "graft_prefix_cache_lookup_tokens_total",
                "Prompt tokens looked up in the prefix cache",
            ),
            preemptions: counter(
                "graft_preemptions_total",
                "Sequences preempted for want of KV blocks",
            ),
            plans_built: counter("graft_batch_plans_built_total", "Batch graphs built"),
            ttft: histogram(
                "graft_time_to_first_token_seconds",
                "Time from a request's arrival to its first token",
                prometheus::exponential_buckets(0.001, 2.0, 18).expect("valid buckets"),
            ),
            tpot: histogram(
                "graft_time_per_output_token_seconds",
                "Time per output token after the first",
                prometheus::exponential_buckets(0.0005, 2.0, 16).expect("valid buckets"),
            ),
            registry,
            last: std::sync::Mutex::new(EngineStats::default()),
        }
    }

    /// Counts a request to `path` answered with `status`.
    pub fn count_request(&self, path: &str, status: u16) {
        let endpoint = ENDPOINTS
            .iter()
            .find(|&&e| e == path)
            .copied()
            .unwrap_or("other");
        self.requests
            .with_label_values(&[endpoint, &status.to_string()])
            .inc();
    }

    /// Takes the engine's counters after a step, with the batch graphs built so far.
    pub fn publish(&self, s: &EngineStats, plans_built: usize) {
        self.waiting.set(s.waiting as i64);
        self.running.set(s.running as i64);
        self.blocks_used.set(s.blocks_used as i64);
        self.blocks_free.set(s.blocks_free as i64);
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        self.prefix_hits
            .inc_by(s.prefix_hit_tokens.saturating_sub(last.prefix_hit_tokens));
        self.prefix_lookups.inc_by(
            s.prefix_lookup_tokens
                .saturating_sub(last.prefix_lookup_tokens),
        );
        self.preemptions
            .inc_by(s.preemptions.saturating_sub(last.preemptions));
        *last = *s;
        self.plans_built
            .inc_by((plans_built as u64).saturating_sub(self.plans_built.get()));
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // encoding into a Vec cannot fail but on a malformed metric, which the names
        // above are not
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_rendered() {
        let m = Metrics::new();
        m.count_request("/v1/completions", 200);
        m.count_request("/nope", 404);
        m.publish(
            &EngineStats {
                running: 3,
                prefix_hit_tokens: 32,
                ..EngineStats::default()
            },
            2,
        );
        m.publish(
            &EngineStats {
                running: 1,
                prefix_hit_tokens: 48,
                ..EngineStats::default()
            },
            5,
        );
        let text = m.render();
        for line in [
            "graft_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1",
            "graft_requests_total{endpoint=\"other\",status=\"404\"} 1",
            "graft_requests_running 1",
            "graft_prefix_cache_hit_tokens_total 48",
            "graft_time_to_first_token_seconds_count 0",
            "graft_kv_blocks_free 0",
            "graft_batch_plans_built_total 5",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
    }
}
