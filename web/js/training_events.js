// Kontext Trainer: the websocket event TrainLoRA sends while it trains. The same constants
// live in nodes/progress_events.py; tests/nodes/test_train_lora.py keeps them equal.
export const PROGRESS_EVENT = "kontext_trainer.progress";
export const STATUSES = ["queued", "running", "cancelled", "finished", "error"];
export const PAYLOAD_FIELDS = [
  "node",
  "prompt_id",
  "workflow_id",
  "lora_name",
  "status",
  "step",
  "total",
  "loss",
  "smoothed_loss",
  "lr",
  "seconds_per_step",
  "eta_seconds",
  "message",
  "previews",
  "validation_loss",
  "validation_step",
  "resume_next",
];
