"""Word lists and templates of the training question bank (experiments/lib/data/question_bank.py): data only.

A template's `{field}` takes a value from the tuple named FIELD here (`{name2}` another value of NAME), or a
number the bank draws (`{a}`, `{price}`, `{quad}`, ...: see question_bank._numbers). Everything here was written
for this bank: none of it comes from a benchmark prompt.
"""

# Word lists packed several to a line: the formatter would put each word on its own line.
# fmt: off

# ---------------------------------------------------------------- shared lists

NAME = (
    "Aisha", "Ben", "Carlos", "Dana", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kofi", "Lena", "Mateo",
    "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Uma", "Victor", "Wei", "Ximena", "Yusuf", "Zoe",
    "Amara", "Bruno", "Chloe", "Dmitri", "Emma", "Felix", "Gabriela", "Hassan", "Ivy", "Jonas", "Keiko", "Liam", "Maya",
    "Noah", "Olga", "Pablo", "Rania", "Samir", "Tomas", "Vera", "Wanjiru", "Yara", "Anton", "Mei",
)
CITY = (
    "Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Melbourne", "Accra", "Bergen", "Valencia", "Chiang Mai",
    "Denver", "Porto", "Glasgow", "Montreal", "Seoul", "Cape Town", "Edinburgh", "Tbilisi", "Bogota", "Hanoi",
    "Leipzig", "Marseille", "Auckland", "Istanbul", "Vancouver", "Dublin", "Mumbai", "Austin", "Tallinn",
)
COMPANY = (
    "Bluefin Analytics", "Northwind Bikes", "Cedar & Stone Furniture", "Lumen Health", "Pebble Robotics",
    "Harbor Coffee Roasters", "Orbit Logistics", "Greenleaf Grocers", "Brightpath Tutoring", "Quill Publishing",
    "Summit Outdoor Gear", "Tidewater Energy", "Maple Street Bakery", "Vertex Software", "Silverline Travel",
    "Kestrel Insurance", "Juniper Labs", "Copperpot Kitchens", "Atlas Fitness", "Redwood Dental Clinic",
)
PRODUCT = (
    "a noise-cancelling travel headset", "a solar-powered phone charger", "a handmade ceramic coffee mug",
    "a standing desk with memory presets", "an insulated steel water bottle", "a beginner's watercolor kit",
    "a smart plant pot that tracks soil moisture", "a lightweight hiking backpack", "a reusable silicone food bag",
    "a mechanical keyboard for programmers", "a cast-iron skillet", "a children's illustrated atlas",
    "an electric cargo bike", "a weighted blanket", "a compact espresso machine", "a waterproof fitness tracker",
    "a wool winter hat knitted by hand", "a bamboo cutting board set", "a portable projector",
    "an ergonomic office chair", "a set of scented soy candles", "a foldable kayak", "a vegan leather wallet",
    "a cordless handheld vacuum", "a sourdough starter kit", "a board game about building train routes",
)
LANGUAGE = (
    "French", "German", "Spanish", "Italian", "Portuguese", "Dutch", "Polish", "Swedish", "Turkish", "Russian",
    "Japanese", "Chinese", "Korean", "Indonesian", "Greek", "Czech",
)
WEEKDAY = (
    "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday",
)
MONTH = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
)
PRODUCT_SHORT = (
    "router", "e-reader", "coffee grinder", "smart speaker", "bike light", "baby monitor", "air purifier",
    "fitness tracker", "robot vacuum", "electric kettle",
)
COLOR = (
    "green", "blue", "white", "orange",
)
THING = (
    "notebook", "pen", "sandwich", "coffee", "hat", "scarf", "bat", "ball", "book", "bookmark",
)
ITEM = (
    "notebooks", "apples", "pencils", "tickets", "cupcakes", "T-shirts", "plant pots", "bus passes", "books", "candles",
    "oranges", "bottles of juice", "packs of cards", "sandwiches", "light bulbs", "tennis balls",
)

# Endings and openings that vary how a question is asked (the empty ending is the most common).
SUFFIX = (
    "", "", "", " Keep it short.", " Use bullet points.", " Please answer in under 200 words.", " Give an example.",
    " Explain it step by step.", " Avoid jargon.", " I'd like a detailed answer.",
    " Answer in two or three paragraphs.", " Be concise but precise.", " Assume I know nothing about it.",
)
ASKER = (
    "I'm a high-school teacher preparing a lesson.", "My daughter asked me this and I didn't know the answer.",
    "I'm studying for a university exam.", "Just curious:", "I'm writing an article for a general audience.",
    "I'm a nurse with little time to read.", "I'm a retired engineer.", "Quick question.", "Settle a debate for us.",
    "I'm learning English, so please use simple words.",
)

# ---------------------------------------------------------------- writing

POEM_FORM = (
    "poem", "haiku", "sonnet", "limerick", "free-verse poem", "short rhyming poem", "ballad", "ode",
)
STORY_FORM = (
    "short story", "fable", "bedtime story", "piece of flash fiction", "fairy tale", "mystery scene",
    "science-fiction story opening", "ghost story for a campfire",
)
CREATIVE_SUBJECT = (
    "a lighthouse keeper's last night on duty", "the first snowfall of winter", "a robot learning to paint",
    "an old bicycle left in the rain", "two strangers sharing an umbrella", "a city waking up at dawn",
    "a grandmother's recipe book", "a cat who thinks it runs the house", "the last day of summer vacation",
    "a letter found in a library book", "a tree that has stood for five hundred years", "moving to a new country",
    "a lost dog finding its way home", "the sound of rain on a tin roof", "a friendship that started online",
    "a musician playing in an empty subway station", "the ocean at night", "a child's first day of school",
    "a small town that only appears once a year", "an astronaut looking back at Earth", "a garden in autumn",
    "a dragon who is afraid of fire", "the smell of fresh bread", "a train that never stops", "a forgotten birthday",
    "a mountain village cut off by snow", "a time traveler stuck in the wrong decade",
    "learning to ride a bike as an adult", "a market on a Saturday morning", "a clock that runs backwards",
    "the quiet after a storm", "a chess game between old rivals", "a bakery that opens at midnight",
    "a whale singing to its calf", "finding courage to speak up", "a houseplant that refuses to die",
    "an inventor whose machine works too well", "a bridge between two feuding villages", "the moon's point of view",
    "the last bookstore in the city", "a kite stuck in a tree", "a detective who cannot smell", "fireflies in June",
)
CONSTRAINT = (
    "", "", " in under 100 words", " in a humorous tone", " for a ten-year-old reader", " that ends with a twist",
    " using vivid sensory details", " written in the second person", " with a hopeful ending",
    " in the style of a nineteenth-century novel", " with no more than five sentences", " that rhymes",
    " in a melancholy mood", " from the point of view of an animal", " with a title", " in exactly three paragraphs",
    " that a teenager would enjoy", " using simple words", " with a strong opening line", " in a calm, gentle voice",
)
EMAIL_TASK = (
    "to my landlord asking to fix the broken heating", "to a professor asking for a deadline extension",
    "to my team announcing that I am leaving the company", "to a customer apologizing for a late delivery",
    "to a hiring manager following up after an interview", "to my neighbor about their dog barking at night",
    "to a colleague asking for feedback on my presentation", "to a client proposing a new project timeline",
    "to the city council supporting a new park", "to my manager asking to work from home two days a week",
    "to a supplier disputing an incorrect invoice", "to a conference organizer proposing a talk",
    "thanking a mentor for their advice over the years", "inviting coworkers to a farewell lunch",
    "to a gym cancelling my membership", "to parents announcing a school trip", "to a hotel asking for a late checkout",
    "declining a job offer politely", "asking a friend to return a book they borrowed", "to a bank about a wrong fee",
    "to volunteers thanking them after a charity event", "to a new employee welcoming them to the team",
)
JOB = (
    "junior data analyst", "barista", "nurse", "software engineer", "marketing coordinator", "librarian",
    "graphic designer", "high-school math teacher", "warehouse supervisor", "customer support specialist",
    "park ranger", "accountant", "UX researcher", "chef", "project manager", "museum guide", "lab technician",
    "social media manager", "electrician apprentice", "translator",
)
STRENGTH = (
    "my experience leading small teams", "my attention to detail", "my background in customer service",
    "a career change from teaching", "my volunteer work", "strong written communication",
    "self-taught programming skills", "fluency in three languages", "a gap year spent travelling",
)
OCCASION = (
    "a best man's toast at my brother's wedding", "a high-school graduation ceremony",
    "the opening of a community garden", "a retirement party for a beloved teacher", "a company's tenth anniversary",
    "the first day of a coding bootcamp", "a charity fundraiser for the local animal shelter",
    "a team that just lost the championship final", "my parents' fortieth wedding anniversary",
    "welcoming new students to a university", "a memorial for a grandparent who loved gardening",
    "an award ceremony for volunteer firefighters",
)
BLOG_TOPIC = (
    "why everyone should learn to cook three simple meals", "my first month of running", "living in a small apartment",
    "how to travel on a tight budget", "what I learned from failing an exam",
    "starting a vegetable garden on a balcony", "the benefits of reading before bed",
    "working remotely without feeling lonely", "learning a language at forty",
    "a weekend in the mountains without a phone", "saving money on groceries", "why board games are making a comeback",
    "adopting a senior dog", "the joy of cycling to work", "getting started with photography", "decluttering a home",
    "how to stay motivated while studying", "visiting a big city for the first time",
    "cooking with seasonal vegetables",
)
AUDIENCE = (
    "busy parents", "first-year university students", "small business owners", "retirees", "beginners", "teenagers",
    "new managers", "people who hate exercise", "remote workers", "complete skeptics",
)
OPINION = (
    "cities should have more bike lanes", "homework should be optional", "every school should teach cooking",
    "public libraries matter more than ever", "a four-day work week is a good idea", "museums should be free",
    "children should learn to code", "people should vote in local elections", "zoos do more good than harm",
    "fast fashion should be taxed", "remote meetings should be shorter", "everyone should learn first aid",
)
CHARACTER = (
    "a retired astronaut", "a nervous magician", "a medieval knight", "a lonely robot", "a street musician",
    "a talking parrot", "a ship's cook", "a young inventor", "a grumpy wizard", "a time traveler", "a night nurse",
)
STYLE = (
    "formal", "friendly", "persuasive", "concise", "poetic", "professional", "enthusiastic", "polite",
)
WRITING_TEMPLATES = (
    "Write a {poem_form} about {creative_subject}{constraint}.",
    "Compose a {poem_form} about {creative_subject}{constraint}.",
    "Could you write me a {poem_form} about {creative_subject}?",
    "Write a {story_form} about {creative_subject}{constraint}.",
    "I need a {story_form} about {creative_subject} for my little sister. Can you write one{constraint}?",
    "Tell me a {story_form} in which {character} meets {character2}.",
    "Draft an email {email_task}{constraint}.",
    "Write a short, {style} email {email_task}.",
    "Help me write an email {email_task}. Keep it {style} and under 150 words.",
    "Write a cover letter for a {job} position at {company}.",
    "I'm applying for a {job} job at {company}. Draft a cover letter that highlights {strength}.",
    "Write a short speech for {occasion}{constraint}.",
    "I have to give a speech at {occasion}. Can you write a two-minute version for me?",
    "Write a blog post about {blog_topic} for {audience}{constraint}.",
    "Give me an outline and an opening paragraph for a blog post about {blog_topic}.",
    "Write a product description for {product}{constraint}.",
    "Write an online store listing for {product}, aimed at {audience}.",
    "Give me five catchy slogans for {product}.",
    "Write a persuasive paragraph arguing that {opinion}.",
    "Write a short opinion piece for a local newspaper arguing that {opinion}.",
    "Write a diary entry from the point of view of {character} about {creative_subject}.",
    "Write a dialogue between {character} and {character2} about {blog_topic}.",
    "Write song lyrics about {creative_subject}, with a chorus that repeats.",
    'Rewrite this sentence so it sounds more {style}: "{everyday_sentence}"',
    "Write a social media post announcing {product} from {company}{constraint}.",
    "Write a review of a fictional restaurant in {city}, mentioning the food, the service and the price.",
    "Write a motivational message for {audience} who feel stuck{constraint}.",
    "Write the opening paragraph of a novel about {creative_subject}.",
    "I run {company} in {city}, and next month we launch {product}. Most of our customers are {audience}. Write "
    "a short newsletter announcement that sounds warm rather than salesy, and end it with a clear call to action.",
    "My colleague {name} is retiring after many years as a {job}. {name} loves gardening, bad puns and long walks. "
    "Write a {poem_form} I can read at the farewell party: affectionate, a little funny, and easy to read aloud.",
    "For a creative writing class I must write a {story_form} about {creative_subject}. It has to stay under 500 "
    "words and have a clear beginning, middle and end. Can you write a draft I can learn from, then explain the "
    "choices you made?",
    "I'm starting a blog about {blog_topic}. Suggest a name for it, write a short 'about me' paragraph, and give "
    "me ten ideas for first posts that would appeal to {audience}.",
)

# ---------------------------------------------------------------- roleplay

ROLE = (
    "a pirate captain", "a medieval blacksmith", "a famous detective in Victorian London", "a friendly barista",
    "a strict but fair chess coach", "a mission controller at a space agency",
    "a travel agent who specializes in Japan", "a job interviewer at a software company",
    "a customer support agent for an internet provider", "a senator in ancient Rome", "a wizard's apprentice",
    "a personal trainer", "a detective in 1920s Chicago", "a tour guide in Kyoto", "a museum curator",
    "a lighthouse keeper", "a Shakespearean actor", "a zookeeper", "a ship's doctor on a long voyage",
    "a librarian in a haunted library", "a cheerful kindergarten teacher", "a grumpy old fisherman",
    "a startup founder pitching to investors", "a nutritionist", "a park ranger", "a news anchor reporting live",
    "a sommelier", "a time traveler from the year 3000", "a medieval innkeeper", "a stand-up comedian",
    "a sports commentator", "a patient piano teacher", "a dragon guarding a treasure", "a car salesperson",
    "a wise old monk", "an astronaut on the International Space Station", "a film director", "a real estate agent",
    "a therapist's receptionist", "a knight returning from a quest", "a fashion designer",
    "a chef running a busy kitchen", "a veterinarian", "a fortune teller at a fair", "a spaceship's AI computer",
    "a 1950s radio host", "a mountain guide", "a flight attendant", "a bookshop owner", "a history professor",
)
SITUATION = (
    "Introduce yourself and describe a typical day at work.",
    "A newcomer asks for your three most important pieces of advice. What do you tell them?",
    "Describe the proudest moment of your career.",
    "Someone tells you your job looks easy. How do you respond?",
    "Tell me about the strangest thing that happened to you this week.",
    "Explain which tools you rely on most, and why.",
    "You just made a big mistake in front of everyone. How do you handle it?",
    "A customer is angry and demands to speak to someone in charge. Respond to them.",
    "Describe your workplace so vividly that I can picture it.",
    "Give a short pep talk to someone who wants to give up.",
    "What would you change about your profession if you could?",
    "Tell a story about the first time you did your job.",
    "I am a child visiting you for the day. Explain what you do in a way I can understand.",
    "Convince me to try something you love.",
    "A journalist asks what people misunderstand about your work. Answer them.",
    "Describe your biggest rival and how you deal with them.",
    "Teach me one useful skill from your line of work, step by step.",
    "It is your last day on the job. Say goodbye to your colleagues.",
    "I ask you for a recommendation. What do you suggest, and why?",
    "Describe a problem you solved recently and how you solved it.",
)
COUNTERPART = (
    "a nervous first-time customer", "your new apprentice", "a journalist writing a profile about you",
    "a skeptical investor", "a lost tourist", "an old friend you have not seen in years", "a curious child",
    "a rival who wants to make peace", "an inspector checking your work", "a famous celebrity in disguise",
)
SCENE = (
    "Start the conversation by greeting me.", "I just walked in looking confused. Begin.",
    "Open the scene with a question for me.", "Start by telling me some news.",
    "Begin by explaining why you asked to see me.",
)
MESSAGE = (
    "I think I'm lost. Can you help me?", "Is this the best you can do?", "I'd like to order something special.",
    "Can you tell me a secret about your work?", "Why should I trust you?", "What is the most important rule here?",
    "I'm not sure I'm ready for this.", "How much will it cost me?", "What do you do when things go wrong?",
)
ROLEPLAY_TEMPLATES = (
    "Pretend you are {role}. {situation}",
    "I want you to act as {role}. {situation}",
    "You are {role}. Stay in character. {situation}",
    "Roleplay as {role}: {situation}",
    "Imagine you are {role}. {situation} Keep it under 150 words.",
    "Let's do a roleplay. You are {role} and I am {counterpart}. {scene}",
    "Act as {role} talking to {counterpart}. {scene}",
    'Respond as {role} would to this message: "{message}"',
    "For the rest of this chat you are {role}. My first question: {message}",
    "Play the part of {role} and answer in the first person. {situation}",
    "Let's play a text adventure. You are {role}, and I am {counterpart} who has just arrived. Describe the scene "
    "in a few sentences, then ask me what I want to do. Keep your replies short and stay in character.",
    "I'm practising for a real conversation. Please act as {role}; I will play {counterpart}. Be realistic, push "
    "back a little when I am vague, and give me feedback at the end. {scene}",
)

# ---------------------------------------------------------------- reasoning

NONSENSE = (
    "bloops", "razzies", "lazzies", "wugs", "florbs", "zints", "grommets", "plinks", "snarfs", "tovs", "quibs", "dax",
    "blickets", "morks", "vexes", "glims",
)
KIND = (
    "cats", "mammals", "birds", "poets", "teachers", "athletes", "musicians", "doctors", "fruits", "vehicles", "metals",
    "students", "gardeners", "painters", "swimmers", "reptiles",
)
ORDER_SETTING = (
    ("finished a race", "crossed the finish line right before", "Who finished"),
    ("stood in line at a bakery", "stood directly in front of", "Who was"),
    ("arrived at a party one after another", "arrived right before", "Who arrived"),
    ("gave talks at a conference, one after another", "spoke right before", "Who spoke"),
    ("were called for job interviews in turn", "was interviewed right before", "Who was interviewed"),
)
MATERIAL = (
    "feathers", "bricks", "steel", "cotton", "water", "gold", "sand", "popcorn",
)
REASONING_TEMPLATES = (
    "All {nonsense} are {nonsense2}. All {nonsense2} are {nonsense3}. Are all {nonsense} {nonsense3}? Explain.",
    "Some {kind} are {kind2}. All {kind2} are {kind3}. Does it follow that some {kind} are {kind3}? Why or why not?",
    "All {kind} are {kind2}. No {kind2} are {nonsense}. Can any {kind} be {nonsense}? Explain your reasoning.",
    "No {nonsense} are {nonsense2}. Some {nonsense3} are {nonsense}. What, if anything, follows about "
    "{nonsense3} and {nonsense2}?",
    "If it rains, the {kind} stay indoors. The {kind} did not stay indoors. What can you conclude, and why?",
    "If {name} studies, {name} passes the exam. {name} passed the exam. Did {name} necessarily study? Explain.",
    "{name} is {a} years older than {name2}. {name2} is twice as old as {name3}, who is {c} years old. "
    "How old is {name}?",
    "In {d} years {name} will be {a} years older than {name2} is today. {name2} is {c} today. How old is {name} now?",
    "It takes {c} machines {c} minutes to make {c} widgets. How long would it take {big} machines to make {big} "
    "widgets?",
    "A {thing} and a {thing2} cost ${total} together. The {thing} costs ${gap} more than the {thing2}. "
    "How much does the {thing2} cost? Think carefully.",
    "If today is {weekday}, what day of the week will it be in {big} days?",
    "What comes next in the sequence {seq}, ...? Explain the pattern.",
    "What is the next number in {geo}, ...? How did you find it?",
    "{name} says {name2} is lying. {name2} says {name3} is lying. {name3} says both {name} and {name2} are lying. "
    "Who is telling the truth?",
    "Which is heavier: a kilogram of {material} or a kilogram of {material2}? Explain.",
    "{name} has {c} sisters, and each sister has one brother. How many children are in the family?",
    "A snail climbs {a} meters up a well during the day and slips back {b_small} meters at night. The well is "
    "{well} meters deep. On which day does the snail get out?",
    "There are {c} people in a room and each shakes hands with every other person once. How many handshakes are there?",
    "A farmer has {k} sheep. All but {c_small} run away. How many are left?",
    "{name} is taller than {name2}, and {name3} is shorter than {name2}. Who is the shortest? Explain.",
    "You have {c} boxes: one holds only apples, one only oranges, and the rest are mixed, and every label is wrong. "
    "How can you fix the labels by tasting as little fruit as possible?",
    "{name} can paint a room in {a} hours and {name2} in {b} hours. How long do they take working together?",
    "A clock shows {clock}. What is the angle between the hour and minute hands?",
    "If {k} cats catch {k} mice in {m} minutes, how many cats are needed to catch {big} mice in {m} minutes?",
    '{name} always lies on {weekday} and tells the truth on other days. {name} says: "Yesterday I lied." '
    "What day could it be?",
)

# ---------------------------------------------------------------- math

MATH_TEMPLATES = (
    "What is {big} times {a}?",
    "Calculate {big} + {big2} - {big_small}.",
    "What is {pct}% of {big}?",
    "Solve for x: {a}x + {b} = {axb}.",
    "Solve the equation {a}(x - {c}) = {acx}. Show your steps.",
    "Find the roots of {quad}.",
    "Solve the system of equations: {system}.",
    "What is {frac} + {frac2}? Give the answer as a simplified fraction.",
    "Multiply {frac} by {frac2} and simplify.",
    "Simplify the fraction {num}/{den}.",
    "What is the sum of the first {k} terms of the sequence {seq}, ...?",
    "Find the least common multiple and the greatest common divisor of {a} and {big_small}.",
    "Is {big} a prime number? Explain how you checked.",
    "Convert {big} to binary.",
    "Round {decimal} to the nearest tenth, then to the nearest whole number.",
    "What is the square root of {square}?",
    "Evaluate {a}^2 - {b} * {c} + {d}.",
    "{name} buys {a} {item} at ${price} each and pays with a ${bill} bill. How much change does {name} get?",
    "A shirt costs ${price}. It is on sale for {pct}% off. What is the sale price?",
    "{name} earns ${hourly} per hour and works {hours} hours a week. How much does {name} earn in {k} weeks?",
    "A train travels {dist} km in {t} hours. What is its average speed?",
    "A car drives at {s} km/h for {t} hours, then at {s2} km/h for {t2} hours. How far does it go in total?",
    "A recipe for {c} people needs {grams} grams of flour. How much flour is needed for {k} people?",
    "A rectangle is {w} cm wide and {h} cm long. What are its area and its perimeter?",
    "A circle has a radius of {r} cm. What is its area? Use pi = 3.14.",
    "A right triangle has legs of {leg} and {leg2}. How long is the hypotenuse?",
    "{name} saves ${hourly} every week. How many weeks does it take to save ${goal}?",
    "{name} puts ${big} in a savings account at {rate}% simple interest per year. How much interest after {t} years?",
    "The price of a {product_short} rose from ${big} to ${big2}. What was the percentage change?",
    "A bag has {a} red marbles and {b} blue marbles. If you pick one at random, what is the probability that it "
    "is red?",
    "You roll two fair dice. What is the probability that the sum is {dice}?",
    "You flip a fair coin {c} times. What is the probability of getting exactly {c_small} heads?",
    "The average of {k} numbers is {a}. If one more number, {big_small}, is added, what is the new average?",
    "{name} read {a} pages on {weekday} and twice as many on each of the next {c} days. How many pages in total?",
    "A tank holds {big} liters. It is filled at {a} liters per minute and drains at {b_small} liters per minute. "
    "How long until it is full?",
    "{name} and {name2} share ${big} in the ratio {a}:{b}. How much does each get?",
    "A store sells {item} in packs of {a} for ${price}. How much do {big_small} {item} cost?",
    "A cyclist covers {dist} km in {t} hours. At the same speed, how long does {dist2} km take?",
    "{k} friends split a bill of ${bill_total} equally and add a {pct}% tip. How much does each pay?",
    "What is {pct}% of {pct2}% of {big}?",
    "The temperature was {temp} degrees Celsius at noon and fell {c} degrees every hour. What was it after {t} hours?",
    "Find the mean, median and mode of these numbers: {data}.",
    "A cube has a side length of {c} cm. What are its volume and its surface area?",
    "Convert {m} minutes and {hours} seconds into seconds.",
    "If {a} workers build a wall in {t} days, how many days would {b} workers need, at the same rate?",
    "{name} is planning a party for {k} guests. Each guest eats about {c_small} slices of pizza, and each pizza has "
    "8 slices. Pizzas cost ${price} each and drinks cost ${a} per guest. How much do food and drinks cost in total?",
    "A school is buying {big_small} {item} for a fair. A pack of {c} costs ${price}. How many packs must it buy, "
    "how much does it spend, and how many {item} are left over?",
    "{name} starts the month with ${big}, spends {pct}% of it on rent and then {pct2}% of what is left on food. "
    "How much money is left?",
    "A store raises a price of ${big} by {pct}% and later lowers the new price by {pct}%. Is the final price the "
    "same as the original? Explain with the numbers.",
)

# ---------------------------------------------------------------- coding

PROG_LANGUAGE = (
    "Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Ruby", "C#", "Kotlin", "Swift", "PHP",
)
CODE_TASK = (
    "reverses the words in a sentence", "checks whether a string is a palindrome", "counts the vowels in a string",
    "returns the n-th Fibonacci number", "removes duplicates from a list while keeping the order",
    "merges two sorted lists into one sorted list", "finds the second largest number in a list",
    "converts a temperature from Celsius to Fahrenheit", "checks whether a number is prime", "flattens a nested list",
    "counts how often each word appears in a text", "validates an email address",
    "finds the longest common prefix of a list of strings", "rotates a matrix by 90 degrees",
    "returns all permutations of a string", "computes the factorial of a number without recursion",
    "converts a Roman numeral to an integer", "checks whether two strings are anagrams",
    "groups a list of words by their first letter", "finds the missing number in a list from 1 to n",
    "implements binary search on a sorted array", "parses a date string like 2024-03-15",
    "sums the digits of an integer", "capitalizes the first letter of every word", "chunks a list into groups of n",
    "finds the most common element in a list", "checks whether parentheses in a string are balanced",
    "converts a number to its English words", "computes the running average of a stream of numbers",
    "returns the intersection of two lists", "implements a simple stack with push and pop",
    "generates a random password of a given length", "computes the distance between two points",
    "reads a text file and prints its ten longest lines", "finds all pairs in a list that sum to a target",
    "implements the bubble sort algorithm", "counts the islands in a grid of 0s and 1s",
    "converts a string to snake_case", "caches the results of an expensive function",
)
CODE_CONCEPT = (
    "recursion", "closures", "big-O notation", "hash tables", "async/await", "generators", "dependency injection",
    "immutability", "pointers", "garbage collection", "unit testing", "regular expressions", "memoization",
    "object-oriented inheritance", "interfaces", "the event loop", "race conditions", "database indexes", "REST APIs",
    "version control branches", "linked lists", "binary trees", "dynamic programming", "type inference", "exceptions",
    "higher-order functions", "lazy evaluation", "concurrency with threads",
)
CODE_PAIR = (
    "a list and a tuple in Python", "TCP and UDP", "git merge and git rebase", "a process and a thread",
    "SQL and NoSQL databases", "== and === in JavaScript", "an abstract class and an interface", "a stack and a queue",
    "compiled and interpreted languages", "let, const and var in JavaScript", "a shallow copy and a deep copy",
    "authentication and authorization", "unit tests and integration tests", "HTTP GET and POST",
    "static and dynamic typing", "an array and a linked list", "a library and a framework",
)
CODE_HOWTO = (
    "read a CSV file", "make an HTTP GET request", "sort a list of objects by one field",
    "parse command-line arguments", "read and write a JSON file", "measure how long a piece of code takes",
    "handle errors when opening a file", "run two tasks at the same time", "format a date as a string",
    "split a string on commas", "remove whitespace from the ends of a string", "write a simple unit test",
    "generate a random number in a range", "check whether a file exists", "join a list of strings with a separator",
    "define a class with a constructor", "log messages to a file", "iterate over a dictionary or map",
    "convert a string to an integer safely",
)
CODING_TEMPLATES = (
    "Write a {prog_language} function that {code_task}.",
    "In {prog_language}, write a program that {code_task}, and explain how it works.",
    "Can you show me how to write a function that {code_task}? Use {prog_language}.",
    "Write a {prog_language} function that {code_task}, then write two tests for it.",
    "What is the time complexity of a function that {code_task}? Explain your reasoning.",
    "How do I {code_howto} in {prog_language}?",
    "What is the simplest way to {code_howto} in {prog_language}? Show a short example.",
    "Explain {code_concept} with a short example in {prog_language}.",
    "I'm new to programming. What are {code_concept}, and when should I use them?",
    "What is the difference between {code_pair}?",
    "When should I choose one over the other: {code_pair}?",
    "I wrote a {prog_language} function that {code_task}, but it is slow on large inputs. How could I speed it up?",
)

# ---------------------------------------------------------------- STEM

STEM_CONCEPT = (
    "photosynthesis", "entropy", "natural selection", "the Doppler effect", "plate tectonics", "DNA replication",
    "Newton's third law", "the greenhouse effect", "quantum entanglement", "black holes", "the immune response",
    "the water cycle", "electromagnetic induction", "chemical equilibrium", "the Pythagorean theorem", "prime numbers",
    "derivatives in calculus", "probability distributions", "the speed of light", "osmosis", "nuclear fission",
    "nuclear fusion", "the periodic table", "covalent bonds", "acids and bases", "vaccines", "antibiotic resistance",
    "the theory of relativity", "the Big Bang", "electric current", "Ohm's law", "semiconductors", "the carbon cycle",
    "cellular respiration", "the nervous system", "neural networks", "public-key cryptography",
    "the Fibonacci sequence", "exponential growth", "friction", "buoyancy", "magnetism", "sound waves",
    "refraction of light", "the Krebs cycle", "mitochondria", "climate feedback loops", "ocean currents", "earthquakes",
    "volcanoes", "the human heart", "genetic mutation", "catalysts", "radioactive decay", "half-life",
    "conservation of energy", "momentum", "torque", "gravity", "standard deviation", "the central limit theorem",
    "matrix multiplication", "complex numbers", "logarithms", "infinity in mathematics", "game theory",
    "machine learning", "the CRISPR gene-editing technique", "stem cells", "the placebo effect", "circadian rhythms",
    "the ozone layer", "renewable energy storage", "how batteries work", "how GPS works", "how airplanes fly",
    "how the internet routes data", "how vaccines are tested",
)
STEM_PAIR = (
    "mitosis and meiosis", "weather and climate", "speed and velocity", "mass and weight", "a virus and a bacterium",
    "fission and fusion", "AC and DC current", "heat and temperature", "an element and a compound", "DNA and RNA",
    "correlation and causation", "a comet and an asteroid", "kinetic and potential energy", "ionic and covalent bonds",
    "permutations and combinations", "mean and median", "accuracy and precision", "a hypothesis and a theory",
    "endothermic and exothermic reactions", "RAM and storage", "innate and adaptive immunity", "stars and planets",
)
STEM_QUESTION = (
    "Why is the sky blue?",
    "Why does ice float on water?",
    "Why do we have seasons?",
    "How do airplanes stay in the air?",
    "Why does the Moon have phases?",
    "How does a refrigerator keep food cold?",
    "Why do leaves change color in autumn?",
    "How does soap remove grease?",
    "Why is the ocean salty?",
    "How do noise-cancelling headphones work?",
    "Why do we need sleep?",
    "How does a microwave oven heat food?",
    "Why do stars twinkle?",
    "How do bees make honey?",
    "Why can't we breathe underwater?",
    "How does a rainbow form?",
    "Why does metal feel colder than wood at the same temperature?",
    "How do vaccines train the immune system?",
    "Why does bread rise?",
    "How do magnets work?",
    "Why is the number zero important in mathematics?",
    "How does a touchscreen know where I touch it?",
    "Why does a spinning top not fall over?",
    "How do solar panels turn sunlight into electricity?",
    "Why do onions make us cry?",
    "How do computers store numbers?",
    "Why are there tides?",
    "How does the heart pump blood around the body?",
    "Why is the square root of two irrational?",
)
STEM_TEMPLATES = (
    "Explain {stem_concept} to a high-school student.{suffix}",
    "What is {stem_concept}, and why does it matter?{suffix}",
    "Can you give me an intuitive explanation of {stem_concept}?{suffix}",
    "How would you explain {stem_concept} to a ten-year-old?{suffix}",
    "What are common misconceptions about {stem_concept}?{suffix}",
    "Give a real-world example of {stem_concept} and explain it.{suffix}",
    "I'm studying for an exam. Summarize the key ideas of {stem_concept} in a few bullet points.{suffix}",
    "Describe {stem_concept} using an everyday analogy.{suffix}",
    "What questions about {stem_concept} are scientists still trying to answer?{suffix}",
    "Explain {stem_concept} step by step, as if I have never heard of it.{suffix}",
    "Write three quiz questions about {stem_concept}, with answers.{suffix}",
    "What is the difference between {stem_pair}?{suffix}",
    "Compare {stem_pair}, with an example of each.{suffix}",
    "Students often confuse {stem_pair}. How would you explain the difference?{suffix}",
    "{stem_question}{suffix}",
    "{stem_question} Please explain it simply.",
    "{stem_question} Give a short answer and then a more detailed one.",
    "{asker} Can you explain {stem_concept}?",
    "{asker} {stem_question}",
    "{asker} What is the difference between {stem_pair}?",
)

# ---------------------------------------------------------------- humanities

HUM_EVENT = (
    "the fall of the Western Roman Empire", "the French Revolution", "the invention of the printing press",
    "the Meiji Restoration", "the Industrial Revolution", "the Renaissance", "the Protestant Reformation",
    "the American Civil War", "the end of apartheid in South Africa", "the fall of the Berlin Wall", "the Black Death",
    "the Silk Road trade", "the partition of India", "the Haitian Revolution", "the moon landing", "the Cold War",
    "the Russian Revolution", "the abolition of the transatlantic slave trade", "the women's suffrage movement",
    "the Great Depression", "the founding of the United Nations", "the Mongol conquests", "the Age of Exploration",
    "the Scientific Revolution", "the collapse of the Soviet Union", "the civil rights movement in the United States",
    "the Ottoman Empire's rise", "the Spanish flu pandemic", "the decolonization of Africa",
    "the building of the Great Wall of China",
)
HUM_PERSON = (
    "Confucius", "Socrates", "Mary Wollstonecraft", "Ibn Khaldun", "Frida Kahlo", "Leonardo da Vinci",
    "Simone de Beauvoir", "Nelson Mandela", "Queen Elizabeth I", "Mahatma Gandhi", "Immanuel Kant", "Jane Austen",
    "William Shakespeare", "Karl Marx", "Adam Smith", "Hannah Arendt", "Frederick Douglass", "Murasaki Shikibu", "Rumi",
    "Marie Curie", "Napoleon Bonaparte", "Cleopatra", "Ada Lovelace", "Plato", "Aristotle", "Friedrich Nietzsche",
    "Toni Morrison", "Gabriel Garcia Marquez", "Vincent van Gogh", "Martin Luther King Jr.", "Genghis Khan",
    "Harriet Tubman", "Rene Descartes", "Virginia Woolf",
)
HUM_CONCEPT = (
    "utilitarianism", "the social contract", "Renaissance humanism", "opportunity cost", "cultural relativism",
    "the hero's journey", "Impressionism", "existentialism", "stoicism", "supply and demand", "inflation",
    "the separation of powers", "nationalism", "Romanticism in literature", "historiography", "magical realism",
    "the tragedy of the commons", "free will", "the categorical imperative", "democracy", "colonialism",
    "globalization", "Baroque music", "Cubism", "epistemology", "moral relativism", "the Enlightenment", "feudalism",
    "postmodernism", "comparative advantage", "the invention of tradition", "satire", "unreliable narrators",
    "linguistic relativity", "human rights", "civil disobedience", "the golden ratio in art", "oral history",
    "minimalism in architecture", "the Harlem Renaissance",
)
HUM_WORK = (
    "Hamlet", "Don Quixote", "The Tale of Genji", "Pride and Prejudice", "1984 by George Orwell", "The Odyssey",
    "One Hundred Years of Solitude", "Things Fall Apart", "Crime and Punishment", "The Great Gatsby", "Frankenstein",
    "The Divine Comedy", "To Kill a Mockingbird", "Beloved", "The Republic by Plato", "Moby-Dick", "Jane Eyre",
    "The Little Prince", "War and Peace", "Leonardo's Mona Lisa", "Picasso's Guernica", "Beethoven's Ninth Symphony",
    "The Epic of Gilgamesh", "Macbeth", "The Analects of Confucius",
)
HUM_PAIR = (
    "stoicism and epicureanism", "socialism and capitalism", "a republic and a democracy", "myth and legend",
    "Baroque and Classical music", "Impressionism and Expressionism", "Plato's and Aristotle's views on knowledge",
    "ethics and morals", "a monarchy and a dictatorship", "primary and secondary historical sources",
    "fiscal and monetary policy", "deontology and consequentialism", "tragedy and comedy in Greek theatre",
)
HUMANITIES_TEMPLATES = (
    "What were the main causes of {hum_event}?{suffix}",
    "What were the long-term consequences of {hum_event}?{suffix}",
    "Explain {hum_event} to a high-school student.{suffix}",
    "How did {hum_event} change everyday life for ordinary people?{suffix}",
    "What lessons can we draw today from {hum_event}?{suffix}",
    "Give a short timeline of {hum_event}.{suffix}",
    "Who was {hum_person}, and why is this person still discussed today?{suffix}",
    "What were {hum_person}'s most important ideas or achievements?{suffix}",
    "How did {hum_person}'s background shape their work?{suffix}",
    "If {hum_person} visited the modern world, what do you think would surprise them most?{suffix}",
    "Explain {hum_concept} in simple terms, with an example.{suffix}",
    "What is {hum_concept}, and what are the main criticisms of it?{suffix}",
    "How has the idea of {hum_concept} changed over time?{suffix}",
    "Give me an example of {hum_concept} from everyday life.{suffix}",
    "Why do people still debate {hum_concept}?{suffix}",
    "What are the main themes of {hum_work}?{suffix}",
    "Why is {hum_work} still studied today?{suffix}",
    "What is the historical context of {hum_work}?{suffix}",
    "I have a book club discussion about {hum_work} next week. Suggest five discussion questions.{suffix}",
    "What is the difference between {hum_pair}?{suffix}",
    "Compare {hum_pair} in a short essay.",
    "{asker} Can you explain {hum_concept}?",
    "{asker} What should I know about {hum_event}?",
    "{asker} Who was {hum_person}?",
)

# ---------------------------------------------------------------- everyday QA

HOWTO = (
    "keep basil alive indoors", "remove a red wine stain from a carpet", "fall asleep faster",
    "make a budget for the first time", "prepare for a job interview", "start running as a complete beginner",
    "learn to touch type", "negotiate a higher salary", "cook rice without a rice cooker", "clean a cast-iron pan",
    "stop procrastinating", "pack a suitcase efficiently", "make friends in a new city", "write a good resume",
    "brew better coffee at home", "save for a house deposit", "keep a conversation going", "care for a new puppy",
    "reduce food waste", "improve my handwriting", "get better at public speaking", "unclog a kitchen sink",
    "choose a good watermelon", "memorize a speech", "organize my email inbox", "start journaling",
    "learn to cook on a budget", "deal with jet lag", "set up a home office", "fix a squeaky door",
    "teach a child to ride a bike", "stay focused while working from home", "plan a road trip",
    "make my phone battery last longer", "train for a 10k race", "keep houseplants alive while on vacation",
    "get rid of fruit flies", "prepare healthy lunches for the week", "improve my posture at a desk",
    "write a thank-you note", "apologize to a friend", "learn a new language faster", "pick a good password",
    "back up my photos", "start a book club", "clean white sneakers", "make a toddler eat vegetables",
    "handle a difficult coworker", "say no without feeling guilty", "choose a laptop for university",
)
ADVICE = (
    "I have a job interview tomorrow and I'm nervous.", "My roommate never does the dishes.",
    "I want to change careers but I'm scared of starting over.", "I keep forgetting my friends' birthdays.",
    "My teenager spends all day on their phone.", "I moved to a new city and I feel lonely.",
    "I spend too much money eating out.", "I can't decide between two job offers.",
    "I have three exams next week and I haven't started studying.", "My neighbor plays loud music late at night.",
    "I want to get fit but I only have twenty minutes a day.",
    "I'm hosting dinner for eight people for the first time.", "My manager gives me vague instructions.",
    "I want to read more books but never find the time.", "My elderly parents need more help at home.",
    "I get stage fright before presentations.",
)
RECOMMEND = (
    "board games for a family with young kids", "books for someone who wants to understand economics",
    "hobbies that don't cost much", "podcasts for learning history", "houseplants that are hard to kill",
    "weekend activities in a big city", "exercises I can do in a small apartment",
    "gifts for a friend who loves cooking", "ways to relax after a stressful day", "healthy snacks for long drives",
    "documentaries about nature", "easy dinners for people who hate cooking",
    "ways to practise a foreign language daily", "apps to keep track of habits",
    "things to do on a rainy day with kids",
)
FACT_QUESTION = (
    "How long does it take light from the Sun to reach Earth?", "How many bones are in the adult human body?",
    "What is the tallest mountain in Africa?", "Why do cats purr?", "How do time zones work?",
    "What is the difference between a crocodile and an alligator?", "Where does the word 'salary' come from?",
    "Why do we celebrate New Year on January 1st?", "How are hurricanes named?", "What makes a diamond so hard?",
    "How many hours of sleep does a teenager need?", "Why do some people sneeze when they look at the sun?",
    "How does a credit score work?", "What is the healthiest way to cook vegetables?",
    "How long can a person survive without water?", "Why do bananas turn brown?", "What is a leap year for?",
)
QA_TEMPLATES = (
    "How do I {howto}?{suffix}",
    "What's the best way to {howto}?{suffix}",
    "Any tips on how to {howto}?{suffix}",
    "I want to {howto}. Where should I start?{suffix}",
    "Can you give me a step-by-step guide to {howto}?{suffix}",
    "What are common mistakes people make when they try to {howto}?{suffix}",
    "Explain briefly how to {howto}.",
    "{advice} Any advice?{suffix}",
    "{advice} What should I do?{suffix}",
    "{advice} What are my options?{suffix}",
    "What are some good {recommend}?{suffix}",
    "Can you recommend a few {recommend}?{suffix}",
    "I'm looking for {recommend}. What would you suggest?{suffix}",
    "{fact_question}{suffix}",
    "{fact_question} Please keep the answer short.",
    "{asker} How do I {howto}?",
    "{asker} {fact_question}",
    "{advice} I've already tried to deal with it once, but nothing changed. What else could I try, and how should "
    "I start?",
    "I want to {howto}, but I have very little time and almost no budget. Can you give me a realistic plan for "
    "the next two weeks?",
)

# ---------------------------------------------------------------- translation

EVERYDAY_SENTENCE = (
    "The meeting has been moved to Thursday afternoon.",
    "Could you tell me where the nearest pharmacy is?",
    "We are looking forward to seeing you at the wedding next month.",
    "The train was delayed because of the snow.",
    "Please remember to water the plants while I am away.",
    "I would like to book a table for four at seven o'clock.",
    "My brother is studying medicine at the university in the capital.",
    "The museum is closed on Mondays.",
    "Thank you for your quick reply and your helpful suggestions.",
    "It has been raining all week, so we stayed home.",
    "The new library will open to the public in the spring.",
    "Can I pay by card, or do you only accept cash?",
    "She learned to play the guitar by watching videos online.",
    "Our flight leaves early, so we should pack tonight.",
    "The children built a snowman in the garden this morning.",
    "I am sorry, but I don't understand the question.",
    "The doctor said I should rest for a few days.",
    "This recipe needs two eggs, a cup of milk and some flour.",
    "We missed the last bus and had to walk home.",
    "The hotel room had a beautiful view of the sea.",
    "He has been working at the same company for ten years.",
    "Do you know a good place to eat near the station?",
    "The price includes breakfast and free parking.",
    "I forgot my umbrella at the office again.",
    "The concert was cancelled because the singer was ill.",
    "Please send me the report before Friday.",
    "My grandmother grows tomatoes and beans in her garden.",
    "The shop on the corner sells fresh bread every day.",
    "We need to leave now if we want to arrive on time.",
    "The package should arrive within three working days.",
)
GERMAN_SENTENCE = (
    "Der Zug nach Hamburg hat heute zwanzig Minuten Verspätung.",
    "Ich habe meinen Schlüssel im Büro vergessen.",
    "Die Regierung plant neue Gesetze zum Schutz des Klimas.",
    "Am Wochenende gehen wir oft im Wald spazieren.",
    "Das Museum zeigt eine Ausstellung über die Geschichte der Stadt.",
    "Könnten Sie mir bitte den Weg zum Bahnhof zeigen?",
    "Die Preise für Lebensmittel sind im letzten Jahr stark gestiegen.",
    "Mein Bruder arbeitet als Ingenieur in München.",
    "Wegen des starken Regens wurde das Fußballspiel abgesagt.",
    "Wir haben uns auf dem Markt frisches Gemüse gekauft.",
    "Die Studie zeigt, dass Kinder mehr Schlaf brauchen als Erwachsene.",
    "Der neue Flughafen wurde nach Jahren eröffnet.",
    "Sie liest jeden Abend ein paar Seiten in ihrem Buch.",
    "Die Firma sucht dringend neue Mitarbeiter.",
    "Im Sommer ist der See voller Touristen.",
    "Der Arzt hat mir geraten, mehr Wasser zu trinken.",
    "Die Ausstellung ist bis Ende März geöffnet.",
    "Nach dem Essen haben wir noch lange geredet.",
    "Viele Menschen fahren inzwischen mit dem Fahrrad zur Arbeit.",
    "Die Bibliothek bleibt am Feiertag geschlossen.",
    "Die Polizei sucht nach Zeugen des Unfalls.",
    "Er hat die Prüfung beim zweiten Versuch bestanden.",
    "In der Altstadt gibt es viele kleine Cafés.",
    "Die Konferenz findet nächstes Jahr in Wien statt.",
)
FRENCH_SENTENCE = (
    "Nous avons visité le vieux port de Marseille pendant les vacances.",
    "Pouvez-vous parler un peu plus lentement ?",
    "Le restaurant est fermé le dimanche soir.",
    "Elle travaille dans une entreprise de logiciels depuis deux ans.",
    "Il fait très chaud aujourd'hui, alors restons à l'ombre.",
    "Le musée propose des visites guidées en anglais.",
    "J'ai oublié d'acheter du pain en rentrant.",
    "Le prochain train part dans un quart d'heure.",
    "Les enfants jouent dans le jardin depuis ce matin.",
    "Nous cherchons un appartement près du centre-ville.",
    "La réunion a été reportée à la semaine prochaine.",
    "Ce livre raconte l'histoire d'une famille pendant la guerre.",
)
SPANISH_SENTENCE = (
    "Mañana vamos a la playa si no llueve.", "¿Sabes a qué hora abre la farmacia?",
    "Mi hermana vive en Madrid desde hace cinco años.", "El concierto empieza a las nueve de la noche.",
    "Necesito comprar un regalo para el cumpleaños de mi madre.", "La biblioteca tiene muchos libros en inglés.",
    "Perdimos el autobús y tuvimos que caminar.", "El médico me dijo que descansara unos días.",
    "Este pueblo es famoso por su queso.", "Hemos reservado una mesa para cuatro personas.",
)
TRANSLATION_TEMPLATES = (
    "Translate into {language}: {everyday_sentence}",
    'How do you say this in {language}? "{everyday_sentence}"',
    "Please translate the following sentence from English to {language}:\n\n{everyday_sentence}",
    "Translate this into {language} and explain any word choices that are tricky: {everyday_sentence}",
    "Translate German to English: {german_sentence}",
    "What does this German sentence mean in English? {german_sentence}",
    "Translate the following German text into English and keep the tone: {german_sentence}",
    "Translate this sentence from German into {language}: {german_sentence}",
    "Translate French to English: {french_sentence}",
    "What does this mean in English? {french_sentence}",
    "Translate Spanish to English: {spanish_sentence}",
    "Can you translate this Spanish sentence into English for me? {spanish_sentence}",
)
# Over a sentence or two of a training-file docstring: {text} is that prose.
DOC_TRANSLATION_TEMPLATES = (
    "Translate into {language}: {text}",
    "Translate the following sentence into {language}:\n\n{text}",
    "Please translate this software documentation into {language}, keeping code names unchanged:\n\n{text}",
    'How would you say this in {language}? "{text}"',
    "Translate to {language} for a user manual: {text}",
)

# ---------------------------------------------------------------- passages: summarization, rag, extraction

# {passage}: prose of a training-file docstring or comment block; {source}: where it comes from.
SUMMARIZATION_TEMPLATES = (
    "Summarize the following text in two sentences:\n\n{passage}",
    "Summarize this passage from {source} for a beginner:\n\n{passage}",
    "Give me a TL;DR of this:\n\n{passage}",
    "Here is a note from {source}:\n\n{passage}\n\nCan you summarize it briefly?",
    "Write a three-bullet summary of the following text:\n\n{passage}",
    "What is the main point of this passage? Answer in one sentence.\n\n{passage}",
    "Summarize the text below in plain English, without jargon.\n\n{passage}",
)
RAG_DOC_TEMPLATES = (
    "Answer the question using only the context below.\n\nContext:\n{passage}\n\nQuestion: What does {name} do, "
    "according to the context?",
    "Read this excerpt from {source}:\n\n{passage}\n\nBased only on the excerpt, what should a programmer keep in mind "
    "when using {name}?",
    "Context:\n{passage}\n\nUsing the context above, explain what problem {name} solves. If the context does not say, "
    "say so.",
    "Use the passage to answer.\n\nPassage:\n{passage}\n\nQuestion: What conditions or special cases does the "
    "passage mention?",
)
EXTRACT_NAME_TEMPLATES = (
    "List every function, method, class or parameter name mentioned in this text:\n\n{passage}",
    "Extract all the code identifiers (names of functions, classes, arguments or modules) from this passage, "
    "one per line:\n\n{passage}",
)
EXTRACT_NUMBER_TEMPLATES = (
    "List every number that appears in this text, with what it refers to:\n\n{passage}",
    "Extract the numbers and quantities from the following text into a table:\n\n{passage}",
)
EXTRACT_ANY_TEMPLATES = (
    "Turn this text into a bulleted list of facts:\n\n{passage}",
    "Extract every condition (if, when, unless) stated in this text:\n\n{passage}",
    "Extract the key terms from the text below and define each in one line, using only the text:\n\n{passage}",
    "From the passage below, extract what the described code returns or produces, as a short list:\n\n{passage}",
)
EXTRACTION_TEMPLATES = (
    "Extract the customer's name, the order number, the total and the delivery date from this email as JSON.\n\n"
    "Hi {name}, thank you for shopping with {company}! Your order #{order} ({a} {item} and {product}) comes to "
    "${price}. It ships from our warehouse in {city} and should arrive on {date}.",
    "From this meeting invitation, list the date, the time, the place and the people invited.\n\n"
    "Hello team, {name} here. Let's meet on {date} at {clock} in the {city} office, room {c}. {name2}, {name3} and "
    "{name4} please bring your quarterly numbers; the meeting should take about {m} minutes.",
    "Extract the job title, the company, the location, the salary and the required experience from this ad.\n\n"
    "{company} is hiring a {job} in {city}. You will have at least {c_small} years of relevant experience. The "
    "salary starts at ${huge} a year, with {d} weeks of paid vacation. Apply to {name} before {date}.",
    "Pull out the rent, the deposit, the size and the move-in date from this listing.\n\n"
    "Sunny {c_small}-bedroom flat in central {city}, {big_small} square meters, on floor {d}. Rent is "
    "${big} per month plus a deposit of ${big2}. Available from {date}. Contact {name} for a viewing.",
    "Read this review and extract the product, the rating, one positive point and one complaint.\n\n"
    "I bought {product} from {company} last month. Setup took about {m} minutes. I like that it is easy to use, "
    "but the battery only lasts {c} hours. Overall I'd give it {stars} out of 5 stars. - {name}",
    "Extract the flight number, the departure city, the arrival city, the date and the seat.\n\n"
    "Dear {name}, your booking is confirmed. Flight FL{big} departs {city} on {date} at {clock} and lands in "
    "{city2} {c} hours later. Seat {c}{seat}. Please arrive at the airport {m} minutes before departure.",
    "Return a JSON object with the event name, date, venue, ticket price and organizer.\n\n"
    "Join us for the {city} Spring Food Fair on {date}! More than {big_small} local vendors, live music and "
    "cooking classes at the old market hall. Tickets cost ${price}; children under {c} enter free. Organized "
    "by {company}.",
    "Extract each person's name and the task assigned to them from these notes.\n\n"
    "Project notes, {date}: {name} will update the website by {weekday}. {name2} is in charge of the budget "
    "review. {name3} will contact {company} about the delayed delivery, and {name4} will book the venue in {city}.",
    "List every amount of money in this message and say what it is for.\n\n"
    "Hi {name}, here is the trip summary: the train tickets were ${price}, the hotel in {city} cost ${big} for "
    "{c_small} nights, the museum passes were ${hourly} each, and we still owe {name2} ${a} for dinner.",
)
# A fictional context, then questions about it (the last ones are not answered by the context on purpose).
RAG_CONTEXTS = (
    (
        "{company} was founded in {year} in {city} by {name} and {name2}. It started as a small workshop with {c} "
        "employees and now employs about {big} people. In {year2} it opened a second office in {city2}. The company "
        "is best known for {product}.",
        "Who founded {company}, and when?",
        "How many people does {company} employ now?",
        "Where did {company} open its second office?",
        "What was {company}'s revenue last year?",
    ),
    (
        "The {city} public library is open from 9 am to {c_small} pm on weekdays and from 10 am to 4 pm on "
        "Saturdays. It is closed on Sundays. Members can borrow up to {d} books for {c} weeks. Late returns cost "
        "${fee} per book per day. Membership is free for residents; others pay ${a} a year.",
        "How many books can a member borrow, and for how long?",
        "Is the library open on Sunday?",
        "How much does a late return cost?",
        "Does the library have a cafe?",
    ),
    (
        "To reset the {product_short}, hold the power button for {c} seconds until the light blinks {color}. Then "
        "release it and wait about {m} seconds. If the light stays red, unplug the device for {d} minutes and try "
        "again. The warranty covers defects for {c_small} years but not water damage.",
        "How do I reset the {product_short}?",
        "What should I do if the light stays red?",
        "Does the warranty cover water damage?",
        "Which color is the device available in?",
    ),
    (
        "The {city} half marathon takes place on {date}. The race starts at {clock} at the old town square and "
        "ends at the harbor. Registration costs ${a} before {month} 1 and ${b_big} after that. There are water "
        "stations every {d} kilometers, and the course closes after {c} hours.",
        "When and where does the race start?",
        "How much does registration cost after {month} 1?",
        "How long do runners have to finish?",
        "Who won the race last year?",
    ),
    (
        "Members of {company}'s gym can cancel with {d} weeks' notice. A monthly membership costs ${b_big}; a yearly "
        "one costs ${big}. Classes must be booked at least {c} hours in advance, and members who miss {k} "
        "classes in a month cannot book for a week. Guests pay ${a} per visit.",
        "How much notice is needed to cancel?",
        "What happens if a member misses too many classes?",
        "How much does a guest pay?",
        "Does the gym have a swimming pool?",
    ),
    (
        "{name} moved to {city} in {year} to study architecture. After graduating, {name} worked for {c} years at "
        "{company} before opening a studio with {name2}. Their studio designed the new {city2} train station, "
        "which opened in {year2} and serves about {huge} passengers a day.",
        "What did {name} study?",
        "Which building did the studio design?",
        "How many passengers use the station each day?",
        "How old is {name}?",
    ),
)
RAG_INTROS = (
    "Answer the question using only the information in the context.",
    "Use the passage below to answer. If the passage does not contain the answer, say so.",
    "Read the text and answer the question based on it alone.",
    "Here is some background information, followed by a question.",
)

# ---------------------------------------------------------------- follow-up turns

FOLLOW_UPS = (
    ("writing", "Now make it shorter."),
    ("writing", "Can you make the tone more playful?"),
    ("writing", "Rewrite it for a more formal audience."),
    ("roleplay", "Stay in character and tell me what happens next."),
    ("roleplay", "Now answer the same thing, but as if you were having a terrible day."),
    ("reasoning", "Can you check your answer a different way?"),
    ("reasoning", "Explain it again as simply as possible."),
    ("math", "Can you check the answer by working backwards?"),
    ("math", "Now explain the method as if to a twelve-year-old."),
    ("coding", "Can you add comments explaining each step?"),
    ("coding", "What edge cases should I watch out for?"),
    ("extraction", "Now format the result as a table."),
    ("extraction", "Which of these items is the most important, and why?"),
    ("stem", "Can you give an example?"),
    ("stem", "What is a good experiment or demonstration that shows this?"),
    ("humanities", "Can you give an example?"),
    ("humanities", "What do critics or historians disagree about here?"),
    ("translation", "Now translate it back into English word by word."),
    ("translation", "Is there a more informal way to say it?"),
    ("summarization", "Now make the summary even shorter: one line."),
    ("summarization", "What questions does the text leave open?"),
    ("qa", "Can you explain that in more detail?"),
    ("qa", "What is the most common mistake to avoid?"),
    ("rag", "Quote the sentence of the context that supports your answer."),
    ("rag", "What else does the context say that might be useful?"),
)
# fmt: on
